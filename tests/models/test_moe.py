"""The mixture-of-experts MLP against a float64 numpy oracle: routing, the grouped matmuls, and the split
layouts (each device's experts, or each device's slice of every expert's width, summed), and the Hopper
kernel's choice in a deviceless H100 compile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.moe import grouped_expert_mlp, grouped_matmul, is_hopper, route
from jaxserve.ops import cpu_kernels
from jaxserve.ops.attention import AttentionConfig
from jaxserve.parallel import on_one_device

E, K, D, F, T = 6, 2, 16, 24, 11


def oracle(x, logits, gate, up, down, normalize: bool) -> np.ndarray:
    """Token by token: softmax over experts in float64, the top k, each expert's SwiGLU MLP."""
    x, logits, gate, up, down = (np.asarray(a, np.float64) for a in (x, logits, gate, up, down))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        probs = np.exp(logits[t] - logits[t].max())
        probs /= probs.sum()
        top = np.argsort(-probs, kind="stable")[:K]
        weights = probs[top] / (probs[top].sum() if normalize else 1.0)
        for w, e in zip(weights, top, strict=True):
            h = x[t] @ gate[e]
            out[t] += w * ((h / (1 + np.exp(-h)) * (x[t] @ up[e])) @ down[e])
    return out


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(0)
    draw = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 0.5  # noqa: E731
    return draw(T, D), draw(T, E) * 3, draw(E, D, F), draw(E, D, F), draw(E, F, D)


@pytest.mark.parametrize("normalize", [True, False])
def test_routed_experts_match_the_oracle(case, normalize):
    x, logits, gate, up, down = case
    weights, experts = route(jnp.asarray(logits), K, normalize)
    got = grouped_expert_mlp(jnp.asarray(x), weights, experts, gate, up, down, num_experts=E)
    np.testing.assert_allclose(np.asarray(got), oracle(x, logits, gate, up, down, normalize), atol=2e-5, rtol=1e-5)


def test_devices_with_their_own_experts_sum_to_the_whole(case):
    """Expert parallel: each of 3 devices computes the rows of its 2 experts (the others come back as zeros);
    their sum is the whole MLP."""
    x, logits, gate, up, down = case
    weights, experts = route(jnp.asarray(logits), K, True)
    parts = [grouped_expert_mlp(jnp.asarray(x), weights, experts, gate[i:i + 2], up[i:i + 2], down[i:i + 2],
                                num_experts=E, first_expert=i) for i in range(0, E, 2)]
    assert all(np.abs(np.asarray(part)).max() > 0 for part in parts)
    np.testing.assert_allclose(np.asarray(sum(parts)), oracle(x, logits, gate, up, down, True), atol=2e-5, rtol=1e-5)


def test_slices_of_every_experts_width_sum_to_the_whole(case):
    """Tensor parallel: 4 devices hold F / 4 columns of gate and up and the matching rows of down."""
    x, logits, gate, up, down = case
    weights, experts = route(jnp.asarray(logits), K, True)
    cols = [slice(i, i + F // 4) for i in range(0, F, F // 4)]
    parts = [grouped_expert_mlp(jnp.asarray(x), weights, experts, gate[..., c], up[..., c], down[:, c], num_experts=E)
             for c in cols]
    np.testing.assert_allclose(np.asarray(sum(parts)), oracle(x, logits, gate, up, down, True), atol=2e-5, rtol=1e-5)


def test_rows_past_the_groups_come_back_as_zeros():
    rows = jnp.ones((8, 4))
    w = jnp.ones((2, 4, 3))
    out = np.asarray(grouped_matmul(rows, w, jnp.asarray([2, 3], jnp.int32)))
    assert (out[:5] == 4).all() and (out[5:] == 0).all()


native_kernels = pytest.mark.skipif(cpu_kernels.kernel_error() is not None or jax.default_backend() != "cpu",
                                    reason=f"the native CPU kernels: {cpu_kernels.kernel_error() or 'not a CPU'}")


@native_kernels
@pytest.mark.parametrize("experts_per_device", [E, 2], ids=["every expert", "expert parallel"])
def test_the_native_grouped_matmul_matches_the_oracle(case, experts_per_device):
    """bfloat16 experts on a CPU through `cpu_kernels.grouped_matmul_bf16`, whole or as devices' shares
    (each device's experts' rows rolled first), against the float64 oracle of the bfloat16 operands."""
    x, logits, gate, up, down = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) for a in case)
    weights, experts = route(jnp.asarray(logits), K, True)
    bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    parts = [grouped_expert_mlp(bf16(x), weights, experts, bf16(gate[i:i + experts_per_device]),
                                bf16(up[i:i + experts_per_device]), bf16(down[i:i + experts_per_device]),
                                num_experts=E, first_expert=i, native=True) for i in range(0, E, experts_per_device)]
    # The hidden activations are rounded to bfloat16 between the matmuls, as on the XLA path.
    np.testing.assert_allclose(np.asarray(sum(parts)), oracle(x, logits, gate, up, down, True), atol=2e-2, rtol=2e-2)
    xla = grouped_expert_mlp(bf16(x), weights, experts, bf16(gate), bf16(up), bf16(down), num_experts=E)
    np.testing.assert_allclose(np.asarray(sum(parts)), np.asarray(xla), atol=1e-4, rtol=1e-4)


@native_kernels
def test_a_cpu_native_step_takes_the_native_grouped_matmul():
    """The block's three grouped matmuls compile to the native kernel with `cpu-native` and bfloat16 experts,
    and to XLA's ragged dot with float32 ones (the kernel multiplies bfloat16 operands only)."""
    from flax import nnx

    from jaxserve.models.moe import MoeConfig, SparseMoeBlock

    attention = AttentionConfig(impl="cpu-native")
    for dtype, calls in ((jnp.bfloat16, 3), (jnp.float32, 0)):
        block = SparseMoeBlock(MoeConfig(num_experts=E, top_k=K, intermediate_size=F, normalize_top_k=True), D,
                               attention, dtype)
        graph, state = nnx.split(block)
        step = jax.jit(lambda state, x, graph=graph: nnx.merge(graph, state)(x))
        hlo = step.lower(state, jnp.ones((T, D), dtype)).as_text()
        assert hlo.count("jaxserve_grouped_matmul_bf16") == calls, dtype


def test_the_mosaic_kernel_is_hoppers():
    assert is_hopper(AttentionConfig(impl="pallas", compute_capability=9.0))
    assert not is_hopper(AttentionConfig(impl="pallas", compute_capability=8.0))
    assert not is_hopper(AttentionConfig(impl="cpu-native"))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the Mosaic GPU kernel runs on a Hopper GPU only")
def test_the_mosaic_grouped_matmul_matches_ragged_dot_on_the_device():
    from jaxserve.ops.attention import cuda_compute_capability

    if not is_hopper(AttentionConfig(impl="pallas", compute_capability=cuda_compute_capability())):
        pytest.skip("not a Hopper GPU")
    rng = np.random.default_rng(1)
    for groups, k, n in ((128, 2048, 768), (32, 2880, 2880)):  # Qwen3-30B-A3B's experts, GPT-OSS-20B's
        counts = rng.multinomial(2000, np.ones(groups) / groups).astype(np.int32)  # 2,000 of 2,048 rows in groups
        rows = jnp.asarray(rng.standard_normal((2048, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((groups, k, n)) * 0.02, jnp.bfloat16)
        got = grouped_matmul(rows, w, jnp.asarray(counts), hopper=True)
        want = jax.lax.ragged_dot(rows, w, jnp.asarray(counts), preferred_element_type=jnp.float32)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "hidden", "width", "kernels"), [
    (256, 128, 8, 2048, 768, 3), (256, 32, 4, 2880, 2880, 3), (16, 32, 4, 2880, 2880, 0)])
def test_the_experts_compile_to_the_mosaic_kernel_for_an_h100(num_tokens, num_experts, top_k, hidden, width,
                                                              kernels):
    """Deviceless: Qwen3-30B-A3B's experts (128 of width 768 over a hidden size of 2,048) and GPT-OSS-20B's
    (32 of 2,880 over 2,880, no multiple of the kernel's 128 columns: 64 at a time), 256 tokens routed to
    top_k each, compile to Mosaic GPU kernels with no dense [E, rows, D] temporary (XLA's own ragged dot
    expands to one, a gigabyte for Qwen3's). A decode's 16 tokens take the Triton grouped matmul instead
    (`ops.grouped_matmul_triton`: a kernel XLA keeps in its command buffers)."""
    from tests.ops.test_paged_attention_pallas import deviceless_h100

    device = deviceless_h100()
    placed = on_one_device(device)
    shapes = [((num_tokens, hidden), jnp.bfloat16), ((num_tokens, top_k), jnp.float32),
              ((num_tokens, top_k), jnp.int32),
              ((num_experts, hidden, width), jnp.bfloat16), ((num_experts, hidden, width), jnp.bfloat16),
              ((num_experts, width, hidden), jnp.bfloat16)]
    structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=placed) for shape, dtype in shapes]
    fn = jax.jit(lambda *a: grouped_expert_mlp(*a, num_experts=num_experts, hopper=True, kernel="compiled"))
    with jax.default_device(device):  # the device the Triton kernel is lowered for (jax 0.12 asks)
        compiled = fn.trace(*structs).lower(lowering_platforms=("cuda",)).compile()
    assert compiled.as_text().count('custom_call_target="mosaic_gpu_v2"') == kernels
    assert compiled.as_text().count("__gpu$xla.gpu.triton") == 3 - kernels
    assert compiled.memory_analysis().temp_size_in_bytes < 64 * 2**20


@pytest.mark.parametrize("block", [0, 8], ids=["per channel", "blocks of 8"])
def test_fp8_experts_are_scaled_to_the_format_s_range_per_expert_channel_and_block(case, block):
    """`quantize_experts`: each expert's output channel's largest |w| over each run of `block` contracted rows
    (all rows per channel) maps to 448, and the values times their scales are the weight to e4m3's rounding."""
    from jaxserve.models.quantization import quantize_experts

    down = case[4]  # [E, F, D]: F = 24 rows in 3 blocks of 8
    q = quantize_experts(jnp.asarray(down), block)
    runs = 1 if not block else F // block
    assert q.values.dtype == jnp.float8_e4m3fn and q.scale.shape == (E, runs, D) and q.block == (block or F)
    values = np.asarray(q.values.astype(jnp.float32)).reshape(E, runs, F // runs, D)
    np.testing.assert_allclose(np.abs(values).max(axis=2), 448.0)
    np.testing.assert_allclose(np.asarray(q.dequantize()), down, rtol=2**-4, atol=1e-6)


def _fp8_slice(w, experts: slice = slice(None), rows: slice = slice(None), columns: slice = slice(None)):
    """One device's share of FP8 experts: its experts, rows or columns, with the scales that cover them (a
    scale per channel whole over any rows)."""
    from jaxserve.models.quantization import Fp8Experts

    blocks = slice(None) if w.per_channel else slice(
        (rows.start or 0) // w.block, None if rows.stop is None else -(-rows.stop // w.block))
    return Fp8Experts(w.values[experts, rows, columns], w.scale[experts, blocks, columns], w.block)


@pytest.mark.parametrize("block", [0, 8, 4], ids=["per channel", "blocks of 8", "blocks of 4"])
def test_fp8_experts_compute_as_their_dequantized_weights_whole_and_split(case, block):
    """The routed MLP over FP8 experts (per channel: the product scaled by each row's expert's scales; blocks:
    the experts dequantized) equals it over their dequantized float32 weights, on one device, over three
    devices' own experts (expert parallel), and over three slices of every expert's width (down's rows in
    whole blocks: one of 8 or two of 4 a slice), the shares summed."""
    from jaxserve.models.quantization import quantize_experts

    x, logits, gate, up, down = case
    q = [quantize_experts(jnp.asarray(w), block) for w in (gate, up, down)]
    dequantized = [w.dequantize() for w in q]
    weights, experts = route(jnp.asarray(logits), K, True)
    x = jnp.asarray(x)
    want = np.asarray(grouped_expert_mlp(x, weights, experts, *dequantized, num_experts=E))
    assert np.abs(want - oracle(*case, True)).max() > 1e-4  # the rounding is there, and the test below sees it
    np.testing.assert_allclose(np.asarray(grouped_expert_mlp(x, weights, experts, *q, num_experts=E)), want,
                               atol=1e-5, rtol=1e-5)
    own = [grouped_expert_mlp(x, weights, experts, *(_fp8_slice(w, experts=slice(i, i + 2)) for w in q),
                              num_experts=E, first_expert=i) for i in range(0, E, 2)]
    np.testing.assert_allclose(np.asarray(sum(own)), want, atol=1e-5, rtol=1e-5)
    widths = [slice(i, i + F // 3) for i in range(0, F, F // 3)]
    sliced = [grouped_expert_mlp(x, weights, experts, _fp8_slice(q[0], columns=c), _fp8_slice(q[1], columns=c),
                                 _fp8_slice(q[2], rows=c), num_experts=E) for c in widths]
    np.testing.assert_allclose(np.asarray(sum(sliced)), want, atol=1e-5, rtol=1e-5)


def test_rows_past_the_groups_of_fp8_experts_come_back_as_zeros():
    from jaxserve.models.quantization import quantize_experts

    w = quantize_experts(jnp.stack([jnp.ones((4, 3)), 2 * jnp.ones((4, 3))]))
    out = np.asarray(grouped_matmul(jnp.ones((8, 4)), w, jnp.asarray([2, 3], jnp.int32)))
    assert (out[:2] == 4).all() and (out[2:5] == 8).all() and (out[5:] == 0).all()
