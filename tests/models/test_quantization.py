"""`--quantization fp8`: e4m3 weights with a scale per output channel, against float64 references; a quantized
model equals the same model with the dequantized weights, and stays close to the unquantized one."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util

from jaxserve.models.layers import dense, merge_heads, project_heads
from jaxserve.models.llama import EXPERT_WEIGHTS
from jaxserve.models.loader import load_model
from jaxserve.models.quantization import (
    FP8_MAX,
    MIN_ROW_SCALE,
    W8A8_MIN_ROWS,
    Fp8Experts,
    Fp8Weight,
    activations_in_fp8,
    quantize_fp8,
    quantize_rows,
    scaled,
    w8a8_matmul,
)
from jaxserve.ops.attention import resolve_attention
from jaxserve.parallel import on_one_device
from tests.models.test_parity import PagedForward

ATTENTION = resolve_attention("cpu")


def _dequantized64(w: Fp8Weight) -> np.ndarray:
    return np.asarray(w.values.astype(jnp.float32), np.float64) * np.asarray(w.scale, np.float64)


@pytest.mark.parametrize(("shape", "contracted"), [((7, 5), 1), ((33, 3, 4), 1), ((3, 4, 9), 2), ((1, 1), 1)])
def test_each_output_channel_is_scaled_to_the_format_s_range(shape, contracted):
    rng = np.random.default_rng(0)
    w = rng.normal(size=shape) * rng.uniform(1e-3, 1e3, size=shape[contracted:])  # channels of any size
    q = quantize_fp8(jnp.asarray(w, jnp.float32), contracted)
    assert q.values.dtype == jnp.float8_e4m3fn and q.scale.shape == shape[contracted:] and q.shape == shape
    axes = tuple(range(contracted))
    np.testing.assert_allclose(np.abs(np.asarray(q.values.astype(jnp.float32))).max(axes), FP8_MAX)
    # e4m3 keeps 3 mantissa bits: each value within half a step (2^-4 relative) of the weight, less below the
    # normal range (2^-6 of 448-scaled units), where the step is fixed
    error = np.abs(_dequantized64(q) - w)
    bound = np.maximum(np.abs(w) * 2.0**-4, 2.0**-10 * np.asarray(q.scale, np.float64))
    assert (error <= bound * (1 + 1e-6)).all()


def test_block_quantization_scales_each_run_of_contracted_rows_per_channel():
    """The form of an FP8 checkpoint's block scales, which its dummy weights and compiles take: each output
    channel's largest |w| in each run of 16 of the 50 flattened contracted rows (the last run 2) maps to 448."""
    rng = np.random.default_rng(4)
    w = rng.normal(size=(5, 10, 7)) * rng.uniform(1e-2, 1e2, size=(5, 10, 1))  # rows of any size: [5 x 10, 7]
    q = quantize_fp8(jnp.asarray(w, jnp.float32), 2, block=16)
    assert (q.block, q.scale.shape, q.shape) == (16, (4, 7), (5, 10, 7))
    rows = np.abs(np.asarray(q.values.astype(jnp.float32)).reshape(50, 7))
    for b, run in enumerate((slice(0, 16), slice(16, 32), slice(32, 48), slice(48, 50))):
        np.testing.assert_allclose(rows[run].max(axis=0), FP8_MAX)
        np.testing.assert_allclose(np.asarray(q.scale)[b], np.abs(w.reshape(50, 7)[run]).max(axis=0) / FP8_MAX,
                                   rtol=1e-6)
    error = np.abs(np.asarray(q.dequantize(), np.float64) - w)
    assert (error <= np.abs(w) * 2.0**-4 + 2.0**-10 * np.abs(w).max() * 1e-2).all()


def test_a_zero_channel_keeps_a_finite_scale():
    q = quantize_fp8(jnp.zeros((4, 3)).at[:, 1].set(2.0), 1)
    assert np.isfinite(np.asarray(q.scale)).all() and np.asarray(q.scale)[0] == 1.0
    np.testing.assert_allclose(_dequantized64(q), np.zeros((4, 3)) + np.array([0, 2.0, 0]), rtol=1e-6, atol=0)


def test_dense_and_the_head_projections_multiply_by_the_dequantized_weights():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(5, 12)), jnp.float32)
    w2 = quantize_fp8(jnp.asarray(rng.normal(size=(12, 7)), jnp.float32), 1)
    np.testing.assert_allclose(dense(x, w2, ATTENTION), np.asarray(x, np.float64) @ _dequantized64(w2), rtol=1e-5,
                               atol=1e-5)
    wq = quantize_fp8(jnp.asarray(rng.normal(size=(12, 3, 4)), jnp.float32), 1)  # [D, N, H]
    want = np.einsum("td,dnh->tnh", np.asarray(x, np.float64), _dequantized64(wq))
    np.testing.assert_allclose(project_heads(x, wq, ATTENTION), want, rtol=1e-5, atol=1e-5)
    wo = quantize_fp8(jnp.asarray(rng.normal(size=(3, 4, 12)), jnp.float32), 2)  # [N, H, D]
    heads = jnp.asarray(rng.normal(size=(5, 3, 4)), jnp.float32)
    want = np.einsum("tnh,nhd->td", np.asarray(heads, np.float64), _dequantized64(wo))
    np.testing.assert_allclose(merge_heads(heads, wo, ATTENTION), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="reshapes to"):
        wq.reshape(-1, 4)  # the heads axis is an output axis: it cannot join the contracted one


def test_one_row_for_a_cuda_gpu_is_padded_to_two_and_gives_the_same_product():
    """XLA:GPU runs some one-row dots as a multiply that writes the weight-sized product (see `dense`);
    for a CUDA target one row goes through as two, and the product is the same, for 16-bit and FP8
    weights alike."""
    from jaxserve.ops.attention import AttentionConfig

    cuda = AttentionConfig(impl="pallas", compute_capability=9.0)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(1, 64)), jnp.bfloat16)
    w16 = jnp.asarray(rng.normal(size=(64, 48)), jnp.bfloat16)
    want = np.asarray(x, np.float64) @ np.asarray(w16, np.float64)
    assert "pad" in str(jax.make_jaxpr(lambda x, w: dense(x, w, cuda))(x, w16))
    np.testing.assert_allclose(np.asarray(dense(x, w16, cuda), np.float64), want, rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(np.asarray(dense(x, w16, cuda)), np.asarray(dense(x, w16, ATTENTION)))
    w8 = quantize_fp8(jnp.asarray(rng.normal(size=(64, 48)), jnp.float32), 1)
    x32 = x.astype(jnp.float32)
    np.testing.assert_allclose(dense(x32, w8, cuda), np.asarray(x32, np.float64) @ _dequantized64(w8), rtol=1e-5,
                               atol=1e-5)


def test_activation_rows_are_each_scaled_to_the_format_s_range():
    """vLLM's dynamic per-token scales: each row's largest |x| becomes 448; a zero row (padding) and a vanishing
    one take the floor, a normal float32 scale, and quantize to zeros."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(7, 40)) * np.array([[1.0], [1e-3], [50.0], [0.0], [1.0], [7.0], [1e-39]])
    x[4, 9] = -300.0  # an outlier takes its row's scale
    xq, scale = quantize_rows(jnp.asarray(x, jnp.float32))
    assert xq.dtype == jnp.float8_e4m3fn and scale.shape == (7, 1)
    values = np.asarray(xq.astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(np.abs(values).max(axis=1), [FP8_MAX] * 3 + [0.0] + [FP8_MAX] * 2 + [0.0])
    np.testing.assert_allclose(scale[:, 0], np.maximum(np.abs(x).max(1) / FP8_MAX, MIN_ROW_SCALE), rtol=1e-6)
    assert scale[3, 0] == scale[6, 0] == np.float32(MIN_ROW_SCALE)
    assert values[4, 9] == -FP8_MAX
    # Each value within e4m3's rounding of x / scale: half a step is 1/16 of a normal value, and 2^-10 below
    # 2^-6, where the format's steps stop shrinking.
    error = np.abs(values - x / np.asarray(scale, np.float64))
    assert np.all(error <= np.maximum(np.abs(x / np.asarray(scale, np.float64)) / 16, 2.0**-10) + 1e-9)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_w8a8_multiplies_the_rounded_rows_by_the_weight_s_values_against_float64(dtype):
    """The product of the e4m3 rows and values, summed in float32, times both scales: as the float64 product of
    the dequantized operands (bfloat16: two roundings of the result, each within half a bfloat16 step)."""
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(37, 96)) * rng.uniform(0.01, 10, size=(37, 1)), dtype)
    w = quantize_fp8(jnp.asarray(rng.normal(size=(96, 80)) * rng.uniform(0.1, 3, size=80), jnp.float32), 1)
    got = w8a8_matmul(x, w)
    assert got.dtype == dtype
    xq, scale = quantize_rows(x)
    want = (np.asarray(xq.astype(jnp.float32), np.float64) * np.asarray(scale, np.float64)) @ _dequantized64(w)
    tolerance = 1e-5 if dtype == jnp.float32 else 2 * 2.0**-8
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tolerance,
                               atol=tolerance * np.abs(want).max() * 1e-2)
    # and near the weight-only product: the rows' rounding is e4m3's, a few percent
    exact = np.asarray(x, np.float64) @ _dequantized64(w)
    assert np.abs(np.asarray(got, np.float64) - exact).mean() < 0.05 * np.abs(exact).mean()


def test_fp8_activations_are_taken_by_large_steps_on_gpus_with_fp8_tensor_cores(monkeypatch):
    """From W8A8_MIN_ROWS rows, on sm_89 and later, for weights with a scale per channel, and for block-scaled
    ones on Ada; A100s, CPUs and fewer rows keep 16-bit activations; JAXSERVE_FP8_ACTIVATIONS decides either
    way."""
    from jaxserve.ops.attention import AttentionConfig

    monkeypatch.delenv("JAXSERVE_FP8_ACTIVATIONS", raising=False)
    rng = np.random.default_rng(7)
    channel = quantize_fp8(jnp.asarray(rng.normal(size=(128, 64)), jnp.float32), 1)
    block = quantize_fp8(jnp.asarray(rng.normal(size=(128, 64)), jnp.float32), 1, block=32)
    hopper, ada = (AttentionConfig(impl="pallas", compute_capability=cc) for cc in (9.0, 8.9))
    a100, cpu = AttentionConfig(impl="pallas", compute_capability=8.0), AttentionConfig(impl="cpu")
    rows = W8A8_MIN_ROWS
    assert activations_in_fp8(rows, channel, hopper) and activations_in_fp8(rows, channel, ada)
    assert not activations_in_fp8(rows - 1, channel, hopper)
    assert not activations_in_fp8(rows, block, hopper)  # (`AttentionConfig.fp8_block_activations`)
    assert activations_in_fp8(rows, block, ada) and not activations_in_fp8(rows - 1, block, ada)
    narrow = quantize_fp8(jnp.asarray(rng.normal(size=(128, 64)), jnp.float32), 1, block=16)
    assert not activations_in_fp8(rows, narrow, ada)  # Triton's 8-bit dots need 32 contracted rows
    assert not any(activations_in_fp8(rows, w, a) for a in (a100, cpu, None) for w in (channel, block))

    def f8_operands(x, attention):  # the dots' operands that are e4m3
        jaxpr = jax.make_jaxpr(lambda x: dense(x, channel, attention))(x)
        return [str(v.aval.dtype) for e in jaxpr.eqns if e.primitive.name == "dot_general" for v in e.invars
                if "float8" in str(v.aval.dtype)]

    x = jnp.asarray(rng.normal(size=(rows, 128)), jnp.bfloat16)
    assert f8_operands(x, hopper) == ["float8_e4m3fn"] * 2
    assert f8_operands(x[:rows - 1], hopper) == []  # (the weight is widened before its dot)
    monkeypatch.setenv("JAXSERVE_FP8_ACTIVATIONS", "0")
    assert not activations_in_fp8(rows, channel, hopper)
    monkeypatch.setenv("JAXSERVE_FP8_ACTIVATIONS", "1")
    assert activations_in_fp8(rows, channel, cpu) and f8_operands(x, cpu) == ["float8_e4m3fn"] * 2
    np.testing.assert_array_equal(np.asarray(dense(x, channel, cpu)), np.asarray(w8a8_matmul(x, channel)))


_ROW_PARALLEL_CHECK = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxserve.models.quantization import quantize_fp8, quantize_rows, w8a8_row_parallel
mesh = Mesh(np.asarray(jax.devices()[:2]), ("tp",))
rng = np.random.default_rng(9)
x = rng.normal(size=(64, 96)) * np.concatenate([np.ones(48), np.full(48, 30.0)])  # the halves' ranges differ
w = quantize_fp8(jnp.asarray(rng.normal(size=(96, 40)), jnp.float32), 1)
x = jax.device_put(jnp.asarray(x, jnp.float32), NamedSharding(mesh, PartitionSpec(None, "tp")))
values = jax.device_put(w.values, NamedSharding(mesh, PartitionSpec("tp", None)))
got = np.asarray(jax.jit(lambda x, v, s: w8a8_row_parallel(x, type(w)(v, s, contracted=1), mesh))(x, values, w.scale))
want = 0
for half in (slice(0, 48), slice(48, 96)):  # each device's share of the rows, quantized with its own scales
    q, scale = quantize_rows(np.asarray(x)[:, half])
    want = want + (np.asarray(q.astype(jnp.float32), np.float64) * np.asarray(scale, np.float64)) @ (
        np.asarray(w.values[half].astype(jnp.float32), np.float64) * np.asarray(w.scale, np.float64))
whole = np.asarray(x, np.float64) @ (np.asarray(w.values.astype(jnp.float32), np.float64) * np.asarray(w.scale))
print(np.abs(got - want).max() / np.abs(want).max(), np.abs(got - whole).mean() / np.abs(whole).mean())
"""


def test_fp8_activations_of_a_row_parallel_product_take_each_device_s_share_of_a_row(tmp_path):
    """Two CPU devices (a process of its own): a weight split along K, its rows split alike; each device
    quantizes its share of each row with a scale of its own, and the sum of the two partial products is their
    float64 sum, near the unrounded product."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"}
    done = subprocess.run([sys.executable, "-c", _ROW_PARALLEL_CHECK], env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    error, off = map(float, done.stdout.split())
    assert error < 1e-6  # float32 sums of the same products
    assert off < 0.05  # e4m3's rounding of rows and weights


def test_fp8_activations_split_over_two_h100s_add_no_all_reduce():
    """Deviceless, two H100s: a row-parallel product (`split_contracted`) with FP8 activations all-reduces its
    partial products once, as with 16-bit activations; a scale over each whole row would add an all-reduce of
    the rows' maxima."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxserve.device import deviceless_devices
    from jaxserve.ops.attention import AttentionConfig

    devices = deviceless_devices("h100", 2)
    mesh = Mesh(np.asarray(devices), ("tp",))
    hopper = AttentionConfig(impl="pallas", compute_capability=9.0, mesh=mesh)
    k, n = 2048, 1024

    def placed(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    x = placed((W8A8_MIN_ROWS, k), jnp.bfloat16, PartitionSpec(None, "tp"))
    w = Fp8Weight(placed((k, n), jnp.float8_e4m3fn, PartitionSpec("tp", None)),
                  placed((n,), jnp.float32, PartitionSpec()), contracted=1)
    for split, all_reduces in ((True, 1), (False, 2)):
        with jax.default_device(devices[0]):
            text = jax.jit(lambda x, w, split=split: dense(x, w, hopper, split)).trace(x, w).lower().compile().as_text()
        assert len(re.findall(r"= \S+ all-reduce(?:-start)?\(", text)) == all_reduces, (split, text[-3000:])
        assert "f8e4m3fn[256,1024]" in text  # each device's share of the rows, in e4m3


@pytest.mark.gpu
def test_fp8_activations_on_the_device_multiply_as_their_definition():
    """On a GPU with FP8 tensor cores (`make test-gpu`): a 2,048-row product by a Llama-3-8B-sized weight takes
    FP8 activations and equals the float64 product of its rounded rows and the dequantized weight, within two
    bfloat16 roundings of the result."""
    from jaxserve.ops.attention import MIN_FP8_COMPUTE_CAPABILITY, AttentionConfig, cuda_compute_capability

    capability = cuda_compute_capability()
    if jax.default_backend() != "gpu" or (capability or 0) < MIN_FP8_COMPUTE_CAPABILITY:
        pytest.skip(f"FP8 tensor cores need a CUDA GPU of sm_{MIN_FP8_COMPUTE_CAPABILITY * 10:.0f} on (this backend: "
                    f"{jax.default_backend()}, compute capability {capability})")
    attention = AttentionConfig(impl="pallas", compute_capability=capability)
    if not attention.fp8_activations:
        pytest.skip("JAXSERVE_FP8_ACTIVATIONS=0 keeps 16-bit activations")
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.normal(size=(2048, 4096)), jnp.bfloat16)
    w = quantize_fp8(jnp.asarray(rng.normal(size=(4096, 1024)) * 0.02, jnp.float32), 1)
    assert activations_in_fp8(x.shape[0], w, attention)
    got = np.asarray(jax.jit(lambda x, w: dense(x, w, attention))(x, w), np.float64)
    xq, scale = quantize_rows(x)
    want = (np.asarray(xq.astype(jnp.float32), np.float64) * np.asarray(scale, np.float64)) @ _dequantized64(w)
    np.testing.assert_allclose(got, want, rtol=2 * 2.0**-8, atol=1e-3 * np.abs(want).max())


def test_fp8_activations_compile_for_an_h100_into_a_gemm_of_two_e4m3_operands():
    """Deviceless: a step of W8A8_MIN_ROWS rows multiplies e4m3 rows by e4m3 values in one GEMM fusion (FP8 tensor
    cores); fewer rows widen the weight inside the GEMM instead."""
    from jaxserve.device import deviceless_devices
    from jaxserve.ops.attention import AttentionConfig

    device = deviceless_devices("h100", 1)[0]
    sharding = on_one_device(device)
    hopper = AttentionConfig(impl="pallas", compute_capability=9.0)
    k, n = 1024, 2048
    weight = Fp8Weight(jax.ShapeDtypeStruct((k, n), jnp.float8_e4m3fn, sharding=sharding),
                       jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sharding), contracted=1)
    for rows in (W8A8_MIN_ROWS, 16):
        x = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16, sharding=sharding)
        text = jax.jit(lambda x, w: dense(x, w, hopper)).trace(x, weight).lower().compile().as_text()
        gemms = re.findall(r"kind=kCustom, calls=%([\w.]*gemm_fusion[\w.]*)", text)  # (jax 0.12 prefixes it)
        assert len(gemms) == 1, gemms
        body = text[text.index(f"%{gemms[0]} ("):]
        parameters = re.findall(r"= (\w+)\[[\d,]*\]\S* parameter\(", body[:body.index("\n}")])
        assert sorted(parameters) == (["f8e4m3fn", "f8e4m3fn"] if rows >= W8A8_MIN_ROWS else ["bf16", "f8e4m3fn"])


def test_a_factor_constant_over_the_contracted_axes_goes_into_the_scale():
    w = quantize_fp8(jnp.asarray(np.random.default_rng(2).normal(size=(6, 3, 4)), jnp.float32), 1)
    factor = np.asarray([2.0, 0.5, 4.0], np.float32)[None, :, None]  # per part, like GPT-2's fused q/k/v
    np.testing.assert_allclose(_dequantized64(scaled(w, factor)), _dequantized64(w) * factor, rtol=1e-6)
    np.testing.assert_allclose(_dequantized64(scaled(w, 0.25)), _dequantized64(w) * 0.25, rtol=1e-6)
    with pytest.raises(ValueError, match="contracted"):
        scaled(w, np.ones((6, 1, 1)))


def _block_weight(rng: np.random.Generator, shape: tuple[int, ...], contracted: int, block: int
                  ) -> tuple[Fp8Weight, np.ndarray]:
    """A random weight with a scale per output channel and run of `block` rows of the flattened contracted
    axis (the last run short where `block` does not divide it), and its float64 value, row by row."""
    k = int(np.prod(shape[:contracted]))
    blocks = -(-k // block)
    values = jnp.asarray(rng.normal(size=shape) * 100, jnp.float32).astype(jnp.float8_e4m3fn)
    scale = rng.uniform(1e-3, 1.0, size=(blocks, *shape[contracted:]))
    rows = np.asarray(values.astype(jnp.float32), np.float64).reshape(k, -1)
    want = np.stack([rows[i] * scale[i // block].reshape(-1) for i in range(k)]).reshape(shape)
    return Fp8Weight(values, jnp.asarray(scale, jnp.float32), contracted=contracted, block=block), want


def test_block_scaled_weights_multiply_as_their_rows_scaled_one_by_one():
    """An FP8 checkpoint's block scales (DeepSeek-V3's `weight_block_size`): each run of `block` contracted rows
    has its own scale per output channel, the last run short where the block does not divide the axis; dense,
    the head projections (whose contracted axes are [N, H] for the output projection) and a factor folded into
    the scales all equal the float64 weight scaled row by row."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(5, 50)), jnp.float32)
    w2, want2 = _block_weight(rng, (50, 7), 1, 16)  # 4 runs: 16, 16, 16, 2
    assert w2.scale.shape == (4, 7)
    np.testing.assert_allclose(np.asarray(w2.dequantize(), np.float64), want2, rtol=1e-6)
    np.testing.assert_allclose(dense(x, w2, ATTENTION), np.asarray(x, np.float64) @ want2, rtol=1e-5, atol=1e-5)
    wq, wantq = _block_weight(rng, (50, 3, 4), 1, 16)  # [D, N, H]
    np.testing.assert_allclose(project_heads(x, wq, ATTENTION),
                               np.einsum("td,dnh->tnh", np.asarray(x, np.float64), wantq), rtol=1e-5, atol=1e-5)
    wo, wanto = _block_weight(rng, (3, 4, 12), 2, 5)  # [N, H, D]: runs of 5 over the 12 flattened [N, H] rows
    heads = jnp.asarray(rng.normal(size=(5, 3, 4)), jnp.float32)
    np.testing.assert_allclose(merge_heads(heads, wo, ATTENTION),
                               np.einsum("tnh,nhd->td", np.asarray(heads, np.float64), wanto), rtol=1e-5, atol=1e-5)
    factor = np.asarray([2.0, 0.5, 4.0], np.float32)[None, :, None]
    np.testing.assert_allclose(np.asarray(scaled(wq, factor).dequantize(), np.float64), wantq * factor, rtol=1e-6)
    with pytest.raises(ValueError, match="reshapes to"):
        wq.reshape(-1, 4)


def _dequantized_state(state: nnx.State) -> dict:
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(state))
    return traverse_util.unflatten_dict(
        {p: v.dequantize(jnp.float32) if isinstance(v, Fp8Weight | Fp8Experts) else v for p, v in flat.items()})


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gemma2", "deepseek-v2", "deepseek-v3", "qwen3-moe"])
def test_a_quantized_model_equals_its_dequantized_weights_and_tracks_the_original(kind, tiny_model_dir):
    directory = str(tiny_model_dir(kind))
    original = load_model(directory, dtype="float32", attention_impl="cpu")
    quantized = load_model(directory, dtype="float32", attention_impl="cpu", quantization="fp8")
    assert quantized.quantization == "fp8"
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(quantized.state))
    fp8 = [p for p, v in flat.items() if isinstance(v, Fp8Weight)]
    family = quantized.spec.module
    layers = range(quantized.cfg.num_layers)
    experts = [p for p, v in flat.items() if p[-1] in getattr(family, "EXPERT_WEIGHTS", ())]
    assert all(isinstance(flat[p], Fp8Experts) and flat[p].per_channel for p in experts)  # a scale per channel
    if kind.startswith("deepseek"):  # V2's query projection or V3's two; a dense MLP or a shared expert a layer
        queries = ["q_proj"] if kind == "deepseek-v2" else ["q_a_proj", "q_b_proj"]
        per_layer = sorted([*queries, "kv_a_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        assert all(sorted(p[-1] for p in fp8 if p[1] == layer) == per_layer for layer in layers)
        assert len(experts) == 3 * (len(layers) - 1)  # the first layer's MLP is dense
    elif kind == "qwen3-moe":  # layer 1's MLP is dense, the others' experts are stacked
        assert sorted(p[1] for p in experts) == [0, 0, 0, 2, 2, 2]
        assert len(fp8) == len(layers) * 4 + 3
    else:
        assert len(fp8) == quantized.cfg.num_layers * len(family.QUANTIZED_WEIGHTS)
    assert not any(isinstance(v, Fp8Weight | Fp8Experts) for p, v in flat.items() if p[0] != family.LAYERS_KEY)

    tokens = np.random.default_rng(3).integers(0, quantized.cfg.vocab_size, size=19).tolist()
    pages = list(range(1, 9))
    got = PagedForward(quantized, pages)(tokens)
    dequantized = load_model(directory, dtype="float32", attention_impl="cpu")
    nnx.replace_by_pure_dict(dequantized.state, _dequantized_state(quantized.state))
    np.testing.assert_allclose(got, PagedForward(dequantized, pages)(tokens), atol=2e-4, rtol=0)

    # Against the unquantized model: e4m3's 3 mantissa bits round each weight by up to 6%, and in these random
    # tiny models every layer's rounding compounds (measured: logits 6-13% off on average, 68-100% of argmaxes
    # kept; 53% for DeepSeek-V3's, whose queries pass two rounded projections, 58% for Qwen3-MoE's, whose rounded
    # router inputs move tokens to other experts); the bundled model's figures are in docs/benchmarks.md.
    want = PagedForward(original, pages)(tokens)
    assert np.abs(got - want).mean() < 0.2 * np.abs(want).mean()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= (0.5 if kind in ("deepseek-v3", "qwen3-moe") else 0.6)


@pytest.mark.parametrize("kind", ["llama", "gemma2", "deepseek-v3"])
def test_a_model_with_fp8_activations_tracks_its_16_bit_activations(kind, tiny_model_dir, monkeypatch):
    """A GPU's large steps' numerics on this CPU (JAXSERVE_FP8_ACTIVATIONS=1, every step of W8A8_MIN_ROWS rows
    here made one of 8): every layer's dense products round their rows to e4m3 too. The logits differ from
    the same FP8 weights' with 16-bit activations, and rounding the activations adds less error against the
    32-bit model than rounding the weights did."""
    from jaxserve.models import quantization

    directory = str(tiny_model_dir(kind))
    quantized = load_model(directory, dtype="float32", attention_impl="cpu", quantization="fp8")
    tokens = np.random.default_rng(4).integers(0, quantized.cfg.vocab_size, size=21).tolist()
    pages = list(range(1, 9))
    want = PagedForward(quantized, pages)(tokens)
    monkeypatch.setenv("JAXSERVE_FP8_ACTIVATIONS", "1")
    monkeypatch.setattr(quantization, "W8A8_MIN_ROWS", 8)
    jax.clear_caches()  # the forward's trace reads them
    got = PagedForward(quantized, pages)(tokens)
    jax.clear_caches()
    original = PagedForward(load_model(directory, dtype="float32", attention_impl="cpu"), pages)(tokens)
    weights_error, both_error = (np.abs(x - original).mean() / np.abs(original).mean() for x in (want, got))
    agree = [(x.argmax(-1) == original.argmax(-1)).mean() for x in (want, got)]
    # Measured, against the 32-bit model's logits: weights alone 6-25% off on average, activations too 8-28% off
    # (these random tiny models compound every layer's rounding); the same argmaxes kept, within a token.
    assert np.abs(got - want).max() > 0
    assert both_error < 2 * weights_error
    assert agree[1] >= agree[0] - 0.1


def test_an_fp8_cache_s_scales_fold_into_fp8_weights(tiny_model_dir):
    from jaxserve.models.kv_scales import fold_kv_scales

    model = load_model(str(tiny_model_dir("llama")), dtype="float32", attention_impl="cpu", quantization="fp8")
    before = _dequantized_state(model.state)
    scales = np.tile(np.asarray([[4.0, 0.5]], np.float32), (model.cfg.num_layers, 1))
    fold_kv_scales(model, scales)
    after = _dequantized_state(model.state)
    layer = ("layers", 0, "self_attn")
    for name, factor in (("q_proj", 4.0), ("k_proj", 0.25), ("v_proj", 2.0), ("o_proj", 0.5)):
        a, b = (traverse_util.flatten_dict(s)[(*layer, name)] for s in (after, before))
        np.testing.assert_allclose(a, np.asarray(b) * factor, rtol=1e-6)


def test_fp8_weights_compile_for_an_h100_into_gemms_that_read_one_byte_per_weight():
    """XLA fuses the widening into its Triton GEMM: no dequantized copy of the weight (no temp buffer)."""
    from jaxserve.device import deviceless_devices

    device = deviceless_devices("h100", 1)[0]
    sharding = on_one_device(device)
    k, n = 1024, 2048
    weight = jax.eval_shape(lambda w: quantize_fp8(w, 1), jax.ShapeDtypeStruct((k, n), jnp.bfloat16))
    args = (jax.ShapeDtypeStruct((16, k), jnp.bfloat16, sharding=sharding),
            Fp8Weight(jax.ShapeDtypeStruct((k, n), weight.values.dtype, sharding=sharding),
                      jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sharding), contracted=1))
    compiled = jax.jit(lambda x, w: dense(x, w, ATTENTION)).trace(*args).lower().compile()
    text = compiled.as_text()
    assert "__triton_nested_gemm_fusion" in text and f"f8e4m3fn[{k},{n}]" in text
    assert compiled.memory_analysis().temp_size_in_bytes < k * n  # the bf16 weight would be 2 * k * n


@pytest.mark.slow
def test_an_fp8_model_compiles_for_an_h100_with_its_layer_weights_halved():
    """The whole step, deviceless: the same buckets in bfloat16 and with FP8 layer weights."""
    from jaxserve.compile_ladder import compile_ladder
    from jaxserve.runner.buckets import Bucket

    buckets = [Bucket(1, 1, decode_only=True)]
    plain, fp8 = (compile_ladder("smollm2-135m", target="h100", preset="gpu", dtype="bfloat16", xla_cost=False,
                                 variants=False, buckets=buckets, read_launches=False, quantization=q,
                                 num_kv_pages=4096)
                  for q in (None, "fp8"))
    # SmolLM2: 30 layers of (q 576x576, k and v 576x192, o 576x576, MLP 3 x 576x1536) bf16 weights -> e4m3
    layer_weights = 30 * (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536)
    channels = 30 * (576 + 2 * 192 + 576 + 2 * 1536 + 576)
    assert plain.weights_bytes - fp8.weights_bytes == layer_weights - 4 * channels  # 2 bytes -> 1, and the scales
    for a, b in zip(plain.buckets, fp8.buckets, strict=True):
        # the roofline reads them once a step (their 155,520 scales count as other weights: 0.1%)
        assert b.bytes == pytest.approx(a.bytes - layer_weights, rel=2e-3) and b.bytes < a.bytes - 0.99 * layer_weights


@pytest.mark.slow
def test_an_fp8_model_s_large_steps_compile_for_an_h100_with_fp8_activations(monkeypatch):
    """The whole step, deviceless: an H100 takes FP8 activations in the 2,048-token bucket, whose layers' matmuls
    the roofline then counts at the FP8 peak, and not in the 16-row decode bucket; JAXSERVE_FP8_ACTIVATIONS=0
    keeps 16-bit activations in both."""
    from jaxserve.compile_ladder import compile_ladder
    from jaxserve.runner.buckets import Bucket

    buckets = [Bucket(16, 16, decode_only=True), Bucket(2048, 16)]
    reports = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("JAXSERVE_FP8_ACTIVATIONS", setting)
        reports[setting] = compile_ladder("smollm2-135m", target="h100", preset="gpu", dtype="bfloat16",
                                          xla_cost=False, variants=False, buckets=buckets, read_launches=False,
                                          quantization="fp8", num_kv_pages=4096)
    (decode, mixed), (decode_16, mixed_16) = reports["1"].buckets, reports["0"].buckets
    assert decode.predicted_seconds == decode_16.predicted_seconds
    assert mixed.flops == mixed_16.flops and mixed.bound == mixed_16.bound == "compute"
    # SmolLM2's layers: 30 x 3.5 M weights, 2 x 2,048 flops each, at 1,979 TFLOP/s rather than 989
    layer_flops = 2 * 2048 * 30 * (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536)
    assert mixed_16.predicted_seconds - mixed.predicted_seconds == pytest.approx(
        layer_flops / 989.4e12 - layer_flops / 1978.9e12, rel=1e-3)


@pytest.mark.slow
def test_an_fp8_checkpoint_with_block_scales_compiles_for_an_h100_as_serve_loads_it(monkeypatch):
    """`jaxserve compile` of a model whose config declares FP8 with blocks of 128 x 64 (here through
    --hf-overrides) compiles its layer weights in e4m3 with their block scales, as serve loads the checkpoint,
    and the decode step's products go through the block-scaled kernel (through Triton and ptxas for sm_90)."""
    from jaxserve.compile_ladder import compile_ladder
    from jaxserve.ops import fp8_block_matmul
    from jaxserve.runner.buckets import Bucket

    products = []
    monkeypatch.setattr(fp8_block_matmul, "fp8_block_matmul",
                        lambda *a, _run=fp8_block_matmul.fp8_block_matmul, **kw: products.append(a[1].shape)
                        or _run(*a, **kw))
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 64]}
    plain, blocks, asked = (
        compile_ladder("smollm2-135m", target="h100", preset="gpu", dtype="bfloat16", xla_cost=False, variants=False,
                       buckets=[Bucket(2, 2, decode_only=True)], read_launches=False, num_kv_pages=4096,
                       hf_overrides=overrides, quantization=quantization)
        for overrides, quantization in ((None, None), ({"quantization_config": fp8}, None),
                                        ({"quantization_config": fp8}, "fp8")))  # --quantization fp8: the same
    layer_weights = 30 * (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536)
    block_scales = 30 * (9 * (576 + 2 * 192 + 576 + 2 * 1536) + 24 * 576)  # K / 64 blocks x N channels, 4 bytes
    assert plain.weights_bytes - blocks.weights_bytes == layer_weights - 4 * block_scales
    assert asked.weights_bytes == blocks.weights_bytes
    # a layer's q [576, 576], k and v [576, 192], o [576, 576], gate and up [576, 1536] and down [1536, 576], as
    # many times as its step was traced
    layer = sorted([(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)])
    traces = len(products) // len(layer)
    assert traces >= 1 and sorted(products) == sorted(layer * traces)


@pytest.mark.slow
def test_a_block_fp8_checkpoint_s_large_steps_compile_for_an_l40s_with_fp8_activations(monkeypatch):
    """The whole step for an L40S (Ada), deviceless: in the 2,048-token bucket a block-FP8 checkpoint's products
    go through the block kernel with rows in e4m3 (a scale per row and block of 64 columns), which the roofline
    counts at the FP8 peak; the decode bucket's rows stay in 16 bits; JAXSERVE_FP8_ACTIVATIONS=0 keeps 16-bit
    rows in both."""
    from jaxserve.compile_ladder import compile_ladder
    from jaxserve.ops import fp8_block_matmul
    from jaxserve.runner.buckets import Bucket

    rows = []
    monkeypatch.setattr(fp8_block_matmul, "fp8_block_matmul",
                        lambda *a, _run=fp8_block_matmul.fp8_block_matmul, **kw: rows.append(str(a[0].dtype))
                        or _run(*a, **kw))
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 64]}
    buckets = [Bucket(16, 16, decode_only=True), Bucket(2048, 16)]
    reports, traced = {}, {}
    for setting in ("1", "0"):
        monkeypatch.setenv("JAXSERVE_FP8_ACTIVATIONS", setting)
        rows.clear()
        reports[setting] = compile_ladder("smollm2-135m", target="l40s", preset="gpu", dtype="bfloat16",
                                          xla_cost=False, variants=False, buckets=buckets, read_launches=False,
                                          num_kv_pages=4096, hf_overrides={"quantization_config": fp8})
        traced[setting] = set(rows)
    assert traced == {"1": {"float8_e4m3fn", "bfloat16"}, "0": {"bfloat16"}}
    (decode, mixed), (decode_16, mixed_16) = reports["1"].buckets, reports["0"].buckets
    assert decode.predicted_seconds == decode_16.predicted_seconds
    layer_flops = 2 * 2048 * 30 * (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536)
    assert mixed.bound == mixed_16.bound == "compute"
    assert mixed_16.predicted_seconds - mixed.predicted_seconds == pytest.approx(
        layer_flops / 362.05e12 - layer_flops / 733e12, rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_blocks", [False, True], ids=["--quantization fp8", "a checkpoint's blocks"])
def test_fp8_experts_compile_split_over_two_h100s(checkpoint_blocks):
    """One Qwen3-30B-A3B layer split over two deviceless H100s with FP8 weights, as a load places them: the
    attention's projections per channel, the 128 experts' values split by width with their scales (per channel:
    down's whole on each device; a checkpoint's blocks of 128: down's 768 rows leave each device three whole
    blocks)."""
    from jaxserve.compile_ladder import compile_ladder
    from jaxserve.runner.buckets import Bucket

    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    options = dict(target="h100", preset="gpu", dtype="bfloat16", xla_cost=False, variants=False,
                   buckets=[Bucket(16, 16, decode_only=True)], read_launches=False, num_kv_pages=4096,
                   tensor_parallel_size=2)
    layer = {"num_hidden_layers": 1}
    plain = compile_ladder("qwen3-30b-a3b", hf_overrides=layer, **options)
    quantized = compile_ladder("qwen3-30b-a3b", **options, **(
        {"hf_overrides": {**layer, "quantization_config": fp8}} if checkpoint_blocks
        else {"hf_overrides": layer, "quantization": "fp8"}))
    # Per device: q and o 16 of 32 heads of 128 over 2,048, k and v 2 of 4; the experts [128, 2,048, 384] x 3
    attention, experts = 2048 * 128 * (16 + 2 + 2 + 16), 3 * 128 * 2048 * 384
    attention_scales = 4 * (16 * 128 + 2 * 2 * 128 + 2048)  # q's [16, 128], k's and v's [2, 128], o's [2048] whole
    # blocks: gate and up [128, 16 blocks, 384], down [128, 3 of 6 blocks, 2048]; per channel: gate and up
    # [128, 1, 384], down [128, 1, 2048] whole
    expert_scales = 4 * (2 * 128 * 16 * 384 + 128 * 3 * 2048 if checkpoint_blocks else 2 * 128 * 384 + 128 * 2048)
    assert plain.weights_bytes - quantized.weights_bytes == attention + experts - attention_scales - expert_scales
    (bucket,) = quantized.buckets
    assert bucket.collectives["all-reduce"] >= 2  # the attention's output and the experts' down projection


@pytest.mark.slow
def test_the_engine_serves_fp8_weights_as_the_model_computes_them(tiny_model_dir):
    """Greedy tokens through the engine (buckets, batching, the CPU paths) equal those of the quantized
    model run token by token, alone and in a staggered batch."""
    from tests.engine.helpers import make_engine, make_prompts, run_alone, run_staggered

    directory = tiny_model_dir("llama")
    engine = make_engine(directory, warmup=False, quantization="fp8")
    model = load_model(str(directory), dtype="float32", attention_impl="cpu", quantization="fp8")
    prompts, max_tokens = make_prompts(4), [7, 5, 9, 6]
    want = []
    for prompt, n in zip(prompts, max_tokens, strict=True):
        forward, tokens = PagedForward(model, list(range(1, 17))), []
        logits = forward(prompt)
        for _ in range(n):
            tokens.append(int(logits[-1].argmax()))
            logits = forward([tokens[-1]])
        want.append(tokens)
    assert [run_alone(engine, p, n) for p, n in zip(prompts[:2], max_tokens[:2], strict=True)] == want[:2]
    batched = run_staggered(engine, prompts, max_tokens, arrivals=[0, 0, 1, 3])
    assert [batched[i] for i in range(4)] == want


def fp8_rows_logits(checkpoint, source, module, kernel_name: str, min_rows: int, monkeypatch) -> tuple:
    """An FP8 checkpoint's logits through the interpreted kernels with JAXSERVE_FP8_ACTIVATIONS "0" and "1"
    (W8A8_MIN_ROWS made `min_rows`), the dtypes of the rows `module.kernel_name` was called with under each,
    and the 32-bit model's logits from `source`: ({setting: logits}, {setting: [row dtypes]}, logits)."""
    from jaxserve.models import quantization

    tokens, pages = list(range(200, 221)), list(range(1, 9))
    logits, rows, run = {}, {}, getattr(module, kernel_name)
    for setting in ("0", "1"):
        monkeypatch.setenv("JAXSERVE_FP8_ACTIVATIONS", setting)
        monkeypatch.setattr(quantization, "W8A8_MIN_ROWS", min_rows)
        jax.clear_caches()  # the forward's trace reads them
        seen = rows[setting] = []
        monkeypatch.setattr(module, kernel_name, lambda *a, _run=run, _seen=seen, **kw:
                            _seen.append(str(a[0].dtype)) or _run(*a, **kw))
        logits[setting] = PagedForward(load_model(str(checkpoint), dtype="float32", attention_impl="interpret"),
                                       pages)(tokens)
        monkeypatch.undo()
    jax.clear_caches()
    original = PagedForward(load_model(str(source), dtype="float32", attention_impl="cpu"), pages)(tokens)
    return logits, rows, original


def _write_fp8_checkpoint(source, target, per_tensor: set[str] = frozenset(), block: tuple[int, int] | None = None,
                          fmt: str = "compressed-tensors", keep: set[str] = frozenset()) -> dict:
    """The tiny model saved as an FP8 checkpoint, its layers' projections in e4m3 but those named in `keep`
    (left as they are, and named in the config's list of modules left out). `fmt` "compressed-tensors": a
    `weight_scale` per output channel, per tensor for the projections named in `per_tensor`, or per block of
    `block` (rows, columns), and a static `input_scale`; "fp8" (DeepSeek-V3's layout): a `weight_scale_inv` per
    block of `block`. Returns each quantized weight's dequantized float32 value by name."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors, dequantized = load_file(str(target / "model.safetensors")), {}
    projections = [n for n in tensors if ".layers." in n
                   and n.endswith(("_proj.weight", "_proj_with_mqa.weight", ".w1.weight", ".w2.weight", ".w3.weight"))]
    left_out = [n for n in projections if any(f".{p}." in n for p in keep)]
    for name in [n for n in projections if n not in left_out]:
        w = tensors[name].to(torch.float32)  # [out, in]
        if block is not None:
            rows, columns = block
            grid = [-(-n // b) for n, b in zip(w.shape, block, strict=True)]
            padded = torch.zeros(grid[0] * rows, grid[1] * columns)
            padded[: w.shape[0], : w.shape[1]] = w
            amax = padded.reshape(grid[0], rows, grid[1], columns).abs().amax(dim=(1, 3))  # [out blocks, in blocks]
            scale = torch.where(amax > 0, amax / 448.0, torch.ones(()))
            full = scale.repeat_interleave(rows, 0).repeat_interleave(columns, 1)[: w.shape[0], : w.shape[1]]
        else:
            channel = not any(f".{p}." in name for p in per_tensor)
            scale = (w.abs().amax(dim=1, keepdim=True) if channel else w.abs().amax().reshape(1)) / 448.0
            full = scale
        values = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[name], tensors[name + ("_scale_inv" if fmt == "fp8" else "_scale")] = values, scale
        if fmt == "compressed-tensors":
            tensors[name.removesuffix("weight") + "input_scale"] = torch.ones(1)
        dequantized[name] = (values.to(torch.float32) * full).numpy()
    save_file(tensors, str(target / "model.safetensors"))
    config = json.loads((target / "config.json").read_text())
    if fmt == "fp8":
        config["quantization_config"] = {
            "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block),
            "modules_to_not_convert": [n.removesuffix(".weight") for n in left_out]}
    else:
        strategy = {"strategy": "block", "block_structure": list(block)} if block else {"strategy": "channel"}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "ignore": ["lm_head", *(n.removesuffix(".weight") for n in left_out)],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "symmetric": True, **strategy}}}}
    (target / "config.json").write_text(json.dumps(config))
    return dequantized


def write_dequantized_checkpoint(source, target, dequantized: dict) -> None:
    """`source`'s checkpoint copied to `target` with the weights `_write_fp8_checkpoint` quantized replaced by
    their dequantized values (`dequantized`, by name) and no quantization: the reference an FP8 checkpoint
    must compute as."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    save_file(tensors | {name: torch.from_numpy(w) for name, w in dequantized.items()},
              str(target / "model.safetensors"))


def _assert_computes_as_dequantized(model, source, dequantized: dict, reference_dir) -> None:
    """`model`'s logits over a prompt equal those of the dequantized checkpoint (`write_dequantized_checkpoint`)."""
    write_dequantized_checkpoint(source, reference_dir, dequantized)
    reference = load_model(str(reference_dir), dtype="float32", attention_impl="cpu")
    tokens = list(range(200, 221))
    np.testing.assert_allclose(PagedForward(model, list(range(1, 9)))(tokens),
                               PagedForward(reference, list(range(1, 9)))(tokens), atol=2e-4, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "phi3"])
def test_an_fp8_checkpoint_keeps_its_own_values_and_scales(kind, tiny_model_dir, tmp_path):
    """A compressed-tensors FP8 checkpoint loads as FP8 without --quantization (as vLLM reads it): each
    weight's e4m3 values are the checkpoint's, and the model computes what the checkpoint's dequantized
    weights give (per-channel and per-tensor scales; Phi-3's fused projections split with their rows'
    scales)."""

    import torch
    from safetensors.torch import load_file

    source = tiny_model_dir(kind)
    dequantized = _write_fp8_checkpoint(source, tmp_path / "fp8", per_tensor={"k_proj", "down_proj", "qkv_proj"})
    model = load_model(str(tmp_path / "fp8"), dtype="float32", attention_impl="cpu")
    assert model.quantization == "fp8"
    weights = traverse_util.flatten_dict(nnx.to_pure_dict(model.state))
    stored = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    for name in ("q_proj", "k_proj") if kind == "llama" else ():  # per channel, per tensor: the checkpoint's own
        weight = weights[("layers", 0, "self_attn", name)]
        checkpoint = stored[f"model.layers.0.self_attn.{name}.weight"].to(torch.float32).numpy().T
        np.testing.assert_array_equal(np.asarray(weight.values.astype(jnp.float32)).reshape(checkpoint.shape),
                                      checkpoint)
        np.testing.assert_allclose(_dequantized64(weight).reshape(checkpoint.shape),
                                   dequantized[f"model.layers.0.self_attn.{name}.weight"].T, rtol=1e-6)

    _assert_computes_as_dequantized(model, source, dequantized, tmp_path / "dequantized")


@pytest.mark.parametrize(("kind", "block", "fmt"), [
    ("llama", (24, 24), "fp8"), ("phi3", (24, 16), "fp8"), ("llama", (16, 24), "compressed-tensors"),
    ("glm4", (16, 24), "fp8"), ("deepseek-v3", (24, 16), "fp8")])
def test_a_checkpoint_with_block_scales_and_weights_left_in_16_bits_computes_what_it_stores(
        kind, block, fmt, tiny_model_dir, tmp_path):
    """DeepSeek-V3's FP8 layout (`weight_block_size`, a `weight_scale_inv` per block) and compressed-tensors'
    "block" strategy, with blocks that do not divide the weights (nor Phi-3's fused projection's split), and
    some projections left in 16 bits: the FP8 weights keep the checkpoint's values with its block scales
    spread over their rows, the others stay as stored (vLLM's reading: not quantized again), and the model
    computes what the checkpoint's dequantized weights give: with GLM-4's query and key rows reordered to the
    rotate-half layout, and DeepSeek-V3's latent attention (its RoPE rows reordered, its latent's projection
    576 rows over blocks of 24, its keys' and values' up-projection dequantized) and experts (kept in e4m3 with
    their block scales)."""

    import torch
    from safetensors.torch import load_file

    source = tiny_model_dir(kind)
    keep = {"llama": {"v_proj", "up_proj"}, "phi3": {"down_proj"}, "glm4": {"v_proj"}, "deepseek-v3": set()}[kind]
    dequantized = _write_fp8_checkpoint(source, tmp_path / "fp8", block=block, fmt=fmt, keep=keep)
    model = load_model(str(tmp_path / "fp8"), dtype="float32", attention_impl="cpu")
    assert model.quantization == "fp8"
    weights = traverse_util.flatten_dict(nnx.to_pure_dict(model.state))
    original = load_file(str(source / "model.safetensors"))
    stored = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    for path, weight in weights.items():
        name = path[-1]
        if kind == "deepseek-v3" and name in EXPERT_WEIGHTS:
            assert isinstance(weight, Fp8Experts) and weight.block == block[1] and not weight.per_channel, path
        if path[0] != "layers" or not name.endswith("_proj"):
            continue
        checkpoint = f"model.layers.{path[1]}.{'.'.join(map(str, path[2:]))}.weight"
        if name in keep:  # as stored: the 16-bit checkpoint's own weight
            assert not isinstance(weight, Fp8Weight)
            np.testing.assert_array_equal(np.asarray(weight).reshape(-1, original[checkpoint].shape[0]),
                                          original[checkpoint].to(torch.float32).numpy().T)
            continue
        assert isinstance(weight, Fp8Weight) and weight.block == block[1], path
        if kind == "llama":  # Phi-3's q/k/v and gate/up come from fused tensors
            np.testing.assert_array_equal(
                np.asarray(weight.values.astype(jnp.float32)).reshape(-1, stored[checkpoint].shape[0]),
                stored[checkpoint].to(torch.float32).numpy().T)
            np.testing.assert_allclose(np.asarray(weight.dequantize()).reshape(-1, stored[checkpoint].shape[0]),
                                       dequantized[checkpoint].T, rtol=1e-6)

    _assert_computes_as_dequantized(model, source, dequantized, tmp_path / "dequantized")


def test_finer_blocks_of_scales_hold_the_same_weights_and_split_experts_whole():
    """`Fp8Tensor.with_block` (a stored weight's scales repeated over finer blocks) dequantizes to the same
    weight, and `experts_block` refines a block only where a split of K would cut one: Qwen3-30B-A3B's down
    projection (768 rows) in blocks of 128 over 4 devices (192 rows a device: blocks of 64)."""
    from jaxserve.models.quantization import Fp8Tensor, experts_block

    rng = np.random.default_rng(5)
    values = jnp.asarray(rng.normal(size=(2, 3, 40)) * 60, jnp.float32).astype(jnp.float8_e4m3fn)
    stored = Fp8Tensor(np.asarray(values), rng.uniform(0.1, 1, size=(2, 3, 3)).astype(np.float32), 16)  # 40 = 16+16+8
    finer = stored.with_block(8)
    assert finer.row_scale().shape == (2, 3, 5)
    np.testing.assert_array_equal(finer.dequantize(), stored.dequantize())
    with pytest.raises(ValueError, match="do not refine"):
        stored.with_block(12)
    assert experts_block((128, 768, 2048), 128, 1, 4) == 64 and experts_block((128, 768, 2048), 128, 1, 2) == 128
    assert experts_block((128, 2048, 768), 128, 2, 4) == 128  # a split of the outputs cuts no block
    assert experts_block((128, 768, 2048), 0, 1, 4) == 0  # a scale per channel stays whole
    assert experts_block((128, 768, 2048), 128, 1, 32) == 0  # 24 rows a device: blocks of 8, too fine: per channel


@pytest.mark.parametrize(("kind", "block", "fmt"), [
    ("qwen3-moe", None, "compressed-tensors"), ("mixtral", None, "compressed-tensors"), ("qwen3-moe", (16, 16), "fp8")])
def test_an_fp8_checkpoint_keeps_its_experts_in_e4m3(kind, block, fmt, tiny_model_dir, tmp_path):
    """A mixture's experts stored in e4m3 (Qwen3-MoE's `gate_proj`..., Mixtral's `w1`...; a scale per channel,
    per tensor for Qwen3-MoE's `down_proj`, or per block) stay so as they are stacked: each layer's experts an
    Fp8Experts holding the checkpoint's own values, and the model computes what the dequantized checkpoint
    gives."""
    import torch
    from safetensors.torch import load_file

    source = tiny_model_dir(kind)
    dequantized = _write_fp8_checkpoint(source, tmp_path / "fp8", per_tensor={"down_proj"}, block=block, fmt=fmt)
    model = load_model(str(tmp_path / "fp8"), dtype="float32", attention_impl="cpu")
    weights = traverse_util.flatten_dict(nnx.to_pure_dict(model.state))
    stored = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    experts = {path: w for path, w in weights.items() if path[-1] in EXPERT_WEIGHTS}
    assert experts and all(isinstance(w, Fp8Experts) for w in experts.values())
    gate = experts[("layers", 0, "mlp", "experts_gate")]
    name = "block_sparse_moe.experts.{}.w1" if kind == "mixtral" else "mlp.experts.{}.gate_proj"
    checkpoint = np.stack([stored[f"model.layers.0.{name.format(e)}.weight"].to(torch.float32).numpy().T
                           for e in range(gate.shape[0])])  # [E, D, F]
    np.testing.assert_array_equal(np.asarray(gate.values.astype(jnp.float32)), checkpoint)
    assert gate.per_channel == (block is None)
    np.testing.assert_allclose(np.asarray(gate.dequantize()), np.stack(
        [dequantized[f"model.layers.0.{name.format(e)}.weight"].T for e in range(gate.shape[0])]), rtol=1e-6)

    _assert_computes_as_dequantized(model, source, dequantized, tmp_path / "dequantized")


def test_dummy_weights_of_a_block_fp8_checkpoint_take_its_form(tiny_model_dir, tmp_path):
    """--load-format dummy (the GPU checks' random weights) of a checkpoint with block scales: its layer weights
    in e4m3 with scales per block of contracted rows, the programs that serve the real weights."""
    _write_fp8_checkpoint(tiny_model_dir("llama"), tmp_path / "fp8", block=(16, 32), fmt="fp8")
    model = load_model(str(tmp_path / "fp8"), dtype="float32", attention_impl="cpu", load_format="dummy")
    weights = traverse_util.flatten_dict(nnx.to_pure_dict(model.state))
    q_proj = weights[("layers", 0, "self_attn", "q_proj")]
    assert model.quantization == "fp8" and isinstance(q_proj, Fp8Weight)
    assert (q_proj.block, q_proj.scale.shape) == (32, (2, 4, 16))  # 64 hidden rows in 2 blocks; [N, H] outputs
    assert all(w.block == 32 for path, w in weights.items() if path[-1].endswith("_proj"))


@pytest.mark.parametrize("config", [
    {"quant_method": "fp8", "weight_block_size": [128]},
    {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}}}},
    {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}},
    {"quant_method": "awq", "bits": 4},
])
def test_quantized_checkpoints_jaxserve_cannot_read_are_refused(config):
    from types import SimpleNamespace

    from jaxserve.models.quantization import checkpoint_quantization

    with pytest.raises(ValueError, match="cannot read"):
        checkpoint_quantization(SimpleNamespace(quantization_config=config))
    assert checkpoint_quantization(SimpleNamespace()) is None
