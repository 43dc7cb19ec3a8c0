"""The block-scaled FP8 weight kernel (`ops.fp8_block_matmul`) against a float64 oracle: compiled on a CUDA GPU
that has it, interpreted elsewhere; its tiling; its compile for an H100 (through Triton and ptxas), which
reads each weight once where XLA writes a widened copy; and a model whose checkpoint has block scales
computing through it what it computes through XLA."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.ops import fp8_block_matmul as kernel
from jaxserve.ops.attention import AttentionConfig, cuda_compute_capability, resolve_impl

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not kernel.TRITON_BACKEND, reason="this jax has no Pallas Triton")]

# Compiled on a GPU that has the kernel; interpreted elsewhere (a CPU, an A100).
COMPILED = (resolve_impl("auto") == "pallas"
            and (cuda_compute_capability() or 0) >= kernel.MIN_COMPUTE_CAPABILITY)


def _case(rng: np.random.Generator, rows: int, k: int, n: int, block: int, dtype):
    x = jnp.asarray(rng.normal(size=(rows, k)), dtype)
    values = jnp.asarray(rng.normal(size=(k, n)) * 60, jnp.float32).astype(jnp.float8_e4m3fn)
    scale = jnp.asarray(rng.uniform(1e-3, 1.0, size=(k // block, n)), jnp.float32)
    weight = np.asarray(values.astype(jnp.float32), np.float64) * np.repeat(np.asarray(scale, np.float64), block, 0)
    return x, values, scale, np.asarray(x.astype(jnp.float32), np.float64) @ weight


@pytest.mark.parametrize(("rows", "k", "n", "block", "num_sms", "splits"), [
    (1, 256, 96, 32, 132, 1),  # one row padded to a tile of 16; 96 outputs in tiles of 32
    (2, 4096, 256, 128, 132, 8),  # a decode step's few rows: the contracted axis split over 8 programs
    (1, 1024, 64, 16, 132, 2),
    (5, 128, 48, 16, 4, 1),
    (70, 64, 128, 32, 1, 1),  # two row tiles (64 + 6), one program an output tile
    (256, 512, 64, 128, 132, 1),
    (600, 256, 128, 64, 132, 1),  # a prefill chunk's rows: ten row tiles
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_kernel_matches_the_float64_oracle(rows, k, n, block, num_sms, splits, dtype):
    assert kernel.tiles(rows, k, n, block, num_sms)[2] == splits
    x, values, scale, want = _case(np.random.default_rng(rows + k), rows, k, n, block, dtype)
    got = kernel.fp8_block_matmul(x, values, scale, block, num_sms=num_sms, interpret=not COMPILED)
    assert got.shape == (rows, n) and got.dtype == x.dtype
    # bfloat16: x's products summed in float32, the result rounded to bfloat16 (8 bits)
    tol = 1e-5 if dtype == jnp.float32 and not COMPILED else 2e-2
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32), np.float64), want,
                               atol=tol * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize(("rows", "k", "n", "num_sms"), [(1, 256, 96, 132), (2, 4096, 256, 132), (70, 256, 128, 1)])
def test_values_stored_k_major_give_the_same_product(rows, k, n, num_sms):
    """`k_major`: the values stored [N, K] (Hopper's layout for its FP8 wgmma kernel, which the Triton kernel then
    serves the small steps from: `fp8_layout.kernel_layout`), split over programs or not, give the product
    the kernel gives over the same values stored [K, N], to the bit."""
    x, values, scale, _ = _case(np.random.default_rng(rows), rows, k, n, 32, jnp.bfloat16)
    row_major = kernel.fp8_block_matmul(x, values, scale, 32, num_sms=num_sms, interpret=not COMPILED)
    stored_t = jnp.asarray(np.asarray(values.astype(jnp.float32)).T).astype(values.dtype)  # [N, K]
    got = kernel.fp8_block_matmul(x, stored_t, scale, 32, num_sms=num_sms, interpret=not COMPILED, k_major=True)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(row_major.astype(jnp.float32)))
    with pytest.raises(ValueError, match="fp8_block_matmul"):  # values stored [K, N] (K != N here)
        kernel.fp8_block_matmul(x, values, scale, 32, interpret=True, k_major=True)


@pytest.mark.parametrize(("rows", "k", "n"), [(1, 4096, 4096), (16, 4096, 1024), (64, 12288, 4096),
                                              (1, 7168, 576), (256, 4096, 12288), (128, 2048, 1536)])
def test_tiles_fill_the_gpu_or_stop_where_partial_sums_would_cost_a_share_of_the_weight(rows, k, n):
    """Every multiprocessor gets two programs (tiles x splits), unless the splits' float32 partial sums
    would pass an eighth of the weight's bytes; splits divide the contracted blocks."""
    block_t, block_n, splits = kernel.tiles(rows, k, n, 128, num_sms=132)
    blocks, row_tiles = k // 128, -(-rows // block_t)
    assert n % block_n == 0 and blocks % splits == 0 and block_t >= min(rows, 64)
    programs = n // block_n * row_tiles * splits
    partial_bytes = lambda s: 4 * s * row_tiles * block_t * n if s > 1 else 0  # noqa: E731
    more = next((s for s in range(splits + 1, blocks + 1) if blocks % s == 0), None)  # the next split count
    assert programs >= 2 * 132 or (block_n <= 32 and (more is None or partial_bytes(more) > k * n / 8))
    assert partial_bytes(splits) <= k * n / 8


@functools.cache
def _h100():
    from jaxserve.device import deviceless_device

    return deviceless_device("h100")


def _triton_calls(compiled) -> int:  # the Pallas Triton kernels an XLA:GPU executable launches
    return sum(line.count("__gpu$xla.gpu.triton") for line in compiled.as_text().splitlines()
               if "custom-call(" in line)


@pytest.mark.parametrize(("rows", "k", "n"), [(2, 4096, 4096), (64, 4096, 14336), (256, 7168, 2048),
                                              (2048, 14336, 4096)])
def test_the_kernel_compiles_for_an_h100_and_reads_each_weight_once(rows, k, n):
    """Deviceless, through Triton and ptxas for sm_90: the step's temporaries are the splits' partial sums
    (under an eighth of the weight's bytes), where XLA's product over the same weight writes a widened copy
    of it (2 bytes a weight)."""
    from jaxserve.models.quantization import Fp8Weight, block_matmul
    from jaxserve.parallel import on_one_device

    sharding = on_one_device(_h100())
    args = (jax.ShapeDtypeStruct((rows, k), jnp.bfloat16, sharding=sharding),
            Fp8Weight(jax.ShapeDtypeStruct((k, n), jnp.float8_e4m3fn, sharding=sharding),
                      jax.ShapeDtypeStruct((k // 128, n), jnp.float32, sharding=sharding), contracted=1, block=128))
    compiled = {}
    for name, attention in (("kernel", AttentionConfig("pallas", num_sms=132, compute_capability=9.0)),
                            ("xla", None)):
        with jax.default_device(_h100()):
            compiled[name] = jax.jit(lambda x, w, a=attention: block_matmul(x, w, a)).trace(*args).lower().compile()
    assert _triton_calls(compiled["kernel"]) == 1 and _triton_calls(compiled["xla"]) == 0
    assert compiled["kernel"].memory_analysis().temp_size_in_bytes <= k * n / 8
    assert compiled["xla"].memory_analysis().temp_size_in_bytes >= 2 * k * n


def test_only_gpus_that_convert_e4m3_and_the_interpreter_take_the_kernel():
    assert AttentionConfig("pallas", compute_capability=9.0).fp8_block_kernel == "compiled"
    assert AttentionConfig("pallas", compute_capability=8.9).fp8_block_kernel == "compiled"
    assert AttentionConfig("pallas", compute_capability=8.0).fp8_block_kernel is None  # an A100: XLA
    assert AttentionConfig("interpret").fp8_block_kernel == "interpret"
    assert AttentionConfig("cpu").fp8_block_kernel is None
    assert AttentionConfig("pallas", compute_capability=9.0, mesh=object()).fp8_block_kernel is None
    assert kernel.fits(4096, 4096, 128) and kernel.fits(14336, 4096, 128)
    assert not kernel.fits(4096, 4096, 24)  # a block Triton's dot cannot take: XLA
    assert not kernel.fits(4000, 4096, 128)  # a short last block


@pytest.mark.slow
def test_a_block_fp8_checkpoint_computes_through_the_kernel_what_it_computes_through_xla(
        tiny_model_dir, tmp_path, monkeypatch):
    """DeepSeek-V3's FP8 layout with blocks of 16 x 32 (64 hidden dims: two blocks) and its 16-bit up
    projections: with the interpreted kernels, each layer's six FP8 products go through the kernel, and the
    model computes what it computes through XLA over the widened weights."""
    from jaxserve.models.loader import load_model
    from tests.models.test_parity import PagedForward
    from tests.models.test_quantization import _write_fp8_checkpoint

    _write_fp8_checkpoint(tiny_model_dir("llama"), tmp_path / "fp8", block=(16, 32), fmt="fp8", keep={"up_proj"})
    jax.clear_caches()  # a layer traced before in this process would not be traced again
    calls = []
    monkeypatch.setattr(kernel, "fp8_block_matmul",
                        lambda *a, _run=kernel.fp8_block_matmul, **kw: calls.append(a[1].shape) or _run(*a, **kw))
    tokens = list(range(200, 213))
    logits = {impl: PagedForward(load_model(str(tmp_path / "fp8"), dtype="float32", attention_impl=impl),
                                 list(range(1, 9)))(tokens)
              for impl in ("interpret", "cpu")}
    # q [64, 64], k and v [64, 32], o [64, 64], gate [64, 128] and down [128, 64]: the identical layers are
    # traced once (`layers.apply_layers`)
    assert sorted(calls) == sorted([(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (128, 64)])
    np.testing.assert_allclose(logits["interpret"], logits["cpu"], atol=2e-4, rtol=0)


@pytest.mark.parametrize(("rows", "k", "n", "block", "num_sms", "splits"), [
    (300, 512, 256, 128, 132, 1),  # five row tiles, the last of 44 rows
    (3, 1024, 64, 64, 132, 2),  # few rows: the contracted axis split
    (64, 256, 96, 32, 4, 1),
])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_rows_in_e4m3_with_a_scale_per_block_match_the_float64_oracle(rows, k, n, block, num_sms, splits,
                                                                       out_dtype):
    """W8A8 with DeepSeek-V3's scales: each row's run of `block` columns quantized with its own scale
    (`quantize_rows(x, block)`), and the kernel's sum equals the float64 product of both dequantized operands."""
    from jaxserve.models.quantization import quantize_rows

    rng = np.random.default_rng(rows + k + n)
    # the columns' ranges differ by block, as activations' outlier channels make them
    x = jnp.asarray(rng.normal(size=(rows, k)) * np.repeat(rng.uniform(0.01, 20, size=k // block), block), jnp.float32)
    _, values, scale, _ = _case(rng, rows, k, n, block, jnp.float32)
    xq, x_scale = quantize_rows(x, block)
    assert xq.dtype == jnp.float8_e4m3fn and x_scale.shape == (rows, k // block)
    assert kernel.tiles(rows, k, n, block, num_sms)[2] == splits
    got = kernel.fp8_block_matmul(xq, values, scale, block, x_scale=x_scale, out_dtype=out_dtype, num_sms=num_sms,
                                  interpret=not COMPILED)
    assert got.shape == (rows, n) and got.dtype == out_dtype
    x64 = np.asarray(xq.astype(jnp.float32), np.float64) * np.repeat(np.asarray(x_scale, np.float64), block, 1)
    weight = np.asarray(values.astype(jnp.float32), np.float64) * np.repeat(np.asarray(scale, np.float64), block, 0)
    want = x64 @ weight
    tol = 1e-5 if out_dtype == jnp.float32 and not COMPILED else 2e-2
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32), np.float64), want, atol=tol * np.abs(want).max(),
                               rtol=0)
    # and the rows' rounding is e4m3's: a few percent from the product of x itself
    exact = np.asarray(x, np.float64) @ weight
    assert np.abs(np.asarray(got.astype(jnp.float32), np.float64) - exact).mean() < 0.05 * np.abs(exact).mean()
    with pytest.raises(ValueError):  # e4m3 rows need their scales, and a dtype for the product
        kernel.fp8_block_matmul(xq, values, scale, block, interpret=True)
    with pytest.raises(ValueError):
        kernel.fp8_block_matmul(xq, values, scale, block, x_scale=x_scale, interpret=True)
    # blocks of 16 take no e4m3 rows: Triton's 8-bit dots need 32 (Ada's e4m3 MMA is k32)
    assert kernel.fits(k, n, block, fp8_rows=True) and not kernel.fits(1024, 64, 16, fp8_rows=True)


def test_block_weights_take_fp8_rows_where_the_kernel_s_e4m3_dot_runs_on_fp8_tensor_cores(monkeypatch):
    """Ada (sm_89) and the interpreter with FP8 activations; not Hopper (its float16 MMAs: the next test), unless
    JAXSERVE_FP8_ACTIVATIONS=1; not an A100, a CPU or a mesh, where the kernel does not run."""
    monkeypatch.delenv("JAXSERVE_FP8_ACTIVATIONS", raising=False)
    ada, hopper = (AttentionConfig("pallas", compute_capability=cc) for cc in (8.9, 9.0))
    assert ada.fp8_block_activations and not hopper.fp8_block_activations
    assert not AttentionConfig("pallas", compute_capability=8.0).fp8_block_activations
    assert not AttentionConfig("pallas", compute_capability=8.9, mesh=object()).fp8_block_activations
    assert not AttentionConfig("interpret").fp8_block_activations  # (no FP8 activations off GPUs by default)
    monkeypatch.setenv("JAXSERVE_FP8_ACTIVATIONS", "1")
    assert hopper.fp8_block_activations and AttentionConfig("interpret").fp8_block_activations
    assert not AttentionConfig("cpu").fp8_block_activations
    monkeypatch.setenv("JAXSERVE_FP8_ACTIVATIONS", "0")
    assert not ada.fp8_block_activations


def _tensor_core_instructions(target: str, rows: int, fp8_rows: bool, k_major: bool = False) -> dict[str, int]:
    """The tensor-core instructions of a [rows, 4096] x [4096, 4096] block-kernel product compiled for `target`."""
    from jaxserve.bench.ptxas import compiled_ptx, tensor_core_instructions
    from jaxserve.device import deviceless_device
    from jaxserve.parallel import on_one_device

    device, k, n = deviceless_device(target), 4096, 4096  # (k = n: K-major values take the same shape)
    sharding = on_one_device(device)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    args = [spec((rows, k), jnp.float8_e4m3fn if fp8_rows else jnp.bfloat16), spec((k, n), jnp.float8_e4m3fn),
            spec((k // 128, n), jnp.float32)] + ([spec((rows, k // 128), jnp.float32)] if fp8_rows else [])

    def product(x, values, scale, x_scale=None):
        return kernel.fp8_block_matmul(x, values, scale, 128, x_scale=x_scale, out_dtype=jnp.bfloat16, k_major=k_major)

    with jax.default_device(device):
        return tensor_core_instructions(compiled_ptx(jax.jit(product).trace(*args).lower()))


@pytest.mark.parametrize(("target", "fp8_rows", "instruction", "k_major"), [
    ("l40s", True, "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32", False),  # Ada: FP8 tensor cores
    ("h100", True, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", False),  # Hopper: widened to float16
    ("h100", False, "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16", False),  # Hopper's 16-bit rows
    ("h100", False, "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16", True),  # and its K-major values
])
def test_the_kernel_s_tensor_core_instructions_for_2048_rows(target, fp8_rows, instruction, k_major):
    """Deviceless, through Triton and ptxas: the instructions `AttentionConfig.fp8_block_activations` rests on.
    With e4m3 rows, Ada's PTX multiplies e4m3 by e4m3; Hopper's widens both to float16 for `mma.sync`, since
    Pallas sets no `max_num_imprecise_acc` and Triton declines wgmma for FP8 without it (should a jax
    change that, this case fails, and Hopper can take FP8 rows); its 16-bit rows run on bfloat16 wgmma."""
    assert set(_tensor_core_instructions(target, 2048, fp8_rows, k_major)) == {instruction}


def test_xla_s_own_fp8_gemm_runs_on_hopper_s_fp8_wgmma_at_a_served_tile():
    """The other W8A8 path (a scale per channel: `quantization.w8a8_matmul`) is XLA's Triton GEMM, which sets
    what Pallas does not: at a tile the autotuner picks on a GPU (given here; a deviceless compile cannot
    autotune, and its default 16 x 8 tile is too small for wgmma), its PTX multiplies e4m3 by e4m3 on wgmma."""
    from jaxserve.bench.ptxas import compiled_ptx, tensor_core_instructions
    from jaxserve.models.quantization import Fp8Weight, w8a8_matmul
    from jaxserve.parallel import on_one_device

    sharding = on_one_device(_h100())
    args = (jax.ShapeDtypeStruct((2048, 4096), jnp.bfloat16, sharding=sharding),
            Fp8Weight(jax.ShapeDtypeStruct((4096, 4096), jnp.float8_e4m3fn, sharding=sharding),
                      jax.ShapeDtypeStruct((4096,), jnp.float32, sharding=sharding), contracted=1))
    tile = "block_m: 128 block_n: 128 block_k: 128 split_k: 1 num_stages: 4 num_warps: 8 num_ctas: 1"
    with jax.default_device(_h100()):
        lowered = jax.jit(w8a8_matmul).trace(*args).lower()
        try:
            ptx = compiled_ptx(lowered, {"xla_gpu_override_gemm_autotuner": tile})
        except jax.errors.JaxRuntimeError as e:
            if "No such compile option" not in str(e):
                raise
            pytest.skip("this jaxlib's XLA takes no GEMM tile override (jaxlib 0.12 does not)")
    assert set(tensor_core_instructions(ptx)) == {"wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"}


@pytest.mark.slow
def test_a_block_fp8_checkpoint_with_fp8_rows_tracks_its_16_bit_rows(tiny_model_dir, tmp_path, monkeypatch):
    """A GPU's large steps on Ada, here interpreted (JAXSERVE_FP8_ACTIVATIONS=1, every step of W8A8_MIN_ROWS rows
    made one of 8): each layer's FP8 products take rows in e4m3 with a scale per row and block of 32 columns,
    and the logits stay near the same weights' with 16-bit rows, nearer than the weights' rounding put them
    from the 32-bit model."""
    from tests.models.test_quantization import _write_fp8_checkpoint, fp8_rows_logits

    _write_fp8_checkpoint(tiny_model_dir("llama"), tmp_path / "fp8", block=(16, 32), fmt="fp8")
    logits, rows, original = fp8_rows_logits(tmp_path / "fp8", tiny_model_dir("llama"), kernel, "fp8_block_matmul", 8,
                                             monkeypatch)
    assert set(rows["0"]) == {"float32"} and set(rows["1"]) == {"float8_e4m3fn"}
    rows_error = np.abs(logits["1"] - logits["0"]).mean() / np.abs(logits["0"]).mean()
    weights_error = np.abs(logits["0"] - original).mean() / np.abs(original).mean()
    assert 0 < rows_error < weights_error
    assert (logits["1"].argmax(-1) == logits["0"].argmax(-1)).mean() >= 0.8
