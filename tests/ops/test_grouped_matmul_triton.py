"""The experts' Triton grouped matmul (`ops.grouped_matmul_triton`), over 16-bit and FP8 experts, against a
float64 oracle: compiled on a CUDA GPU that has it, interpreted elsewhere; its tile layout; its compile for an
H100 and an A100 (through Triton and ptxas), whose temporaries do not grow with the experts where XLA's ragged
dot writes every row's product with every expert; and mixtures (an FP8 checkpoint, bfloat16 experts)
computing through it what they compute through XLA."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.ops import grouped_matmul_triton as kernel
from jaxserve.ops.attention import AttentionConfig, cuda_compute_capability, resolve_impl
from jaxserve.ops.fp8_block_matmul import MIN_COMPUTE_CAPABILITY, TRITON_BACKEND

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not TRITON_BACKEND, reason="this jax has no Pallas Triton")]

def _compiled(fp8: bool) -> bool:
    """Whether this machine runs the kernel compiled (a CUDA GPU of sm_80 on; sm_89 on for e4m3 experts), else
    interpreted."""
    needed = MIN_COMPUTE_CAPABILITY if fp8 else kernel.MIN_COMPUTE_CAPABILITY
    return resolve_impl("auto") == "pallas" and (cuda_compute_capability() or 0) >= needed


def _case(rng: np.random.Generator, group_sizes: list[int], extra_rows: int, k: int, n: int, block: int, dtype):
    """Sorted rows (with `extra_rows` past the groups), e4m3 experts and their scales (`block` 0: 16-bit experts
    of the rows' dtype and no scales), and the float64 oracle."""
    num_groups, num_rows = len(group_sizes), sum(group_sizes) + extra_rows
    rows = jnp.asarray(rng.normal(size=(num_rows, k)), dtype)
    if block:
        values = jnp.asarray(rng.normal(size=(num_groups, k, n)) * 60, jnp.float32).astype(jnp.float8_e4m3fn)
        blocks = 1 if block >= k else k // block
        scale = jnp.asarray(rng.uniform(1e-3, 1.0, size=(num_groups, blocks, n)), jnp.float32)
        weights = (np.asarray(values.astype(jnp.float32), np.float64)
                   * np.repeat(np.asarray(scale, np.float64), k // blocks, axis=1))  # [G, K, N]
    else:
        values, scale = jnp.asarray(rng.normal(size=(num_groups, k, n)), dtype), None
        weights = np.asarray(values.astype(jnp.float32), np.float64)
    x = np.asarray(rows.astype(jnp.float32), np.float64)
    want, start = np.zeros((num_rows, n)), 0
    for group, size in enumerate(group_sizes):
        want[start:start + size] = x[start:start + size] @ weights[group]
        start += size
    return rows, values, scale, jnp.asarray(group_sizes, jnp.int32), want


@pytest.mark.parametrize(("group_sizes", "extra_rows", "k", "n", "block"), [
    ([1, 0, 2, 1, 0, 0, 3, 1], 0, 256, 96, 256),  # a decode step: a row or two an expert, some none; per channel
    ([1, 0, 2, 1, 0, 0, 3, 1], 0, 256, 96, 64),  # the same with block scales
    ([1, 0, 2, 1, 0, 0, 3, 1], 0, 256, 96, 0),  # and 16-bit experts
    ([40, 3, 0, 17], 4, 128, 64, 32),  # tiles of 16 over experts of 40 and 17 rows; rows past the groups
    ([40, 3, 0, 17], 4, 128, 64, 0),
    ([70, 90], 0, 64, 48, 64),  # tiles of 64 (80 rows an expert on average), 48 outputs in tiles of 16
    ([0, 0, 5], 3, 48, 32, 48),  # K of 48: contracted tiles of 16
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_the_kernel_matches_the_float64_oracle(group_sizes, extra_rows, k, n, block, dtype):
    if not block and dtype == jnp.float32:
        pytest.skip("16-bit experts take rows of their dtype")
    rows, values, scale, sizes, want = _case(np.random.default_rng(k + n), group_sizes, extra_rows, k, n, block,
                                             dtype)
    compiled = _compiled(fp8=bool(block))
    got = kernel.grouped_matmul(rows, values, sizes, scale, block, interpret=not compiled)
    assert got.shape == want.shape and got.dtype == jnp.float32
    assert (np.asarray(got)[sum(group_sizes):] == 0).all()  # rows past the groups
    tol = 1e-5 if dtype == jnp.float32 and not compiled else 2e-2  # 16-bit rows; a GPU's TF32 dots
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize(("group_sizes", "extra_rows", "k", "n", "block"), [
    ([1, 0, 2, 1, 0, 0, 3, 1], 0, 256, 96, 256),  # per channel: a scale per row
    ([1, 0, 2, 1, 0, 0, 3, 1], 0, 256, 96, 64),  # block scales: a scale per row and block
    ([40, 3, 0, 17], 4, 128, 64, 32),  # rows past the groups
    ([70, 90], 0, 64, 48, 64),
])
def test_rows_in_e4m3_match_the_float64_oracle(group_sizes, extra_rows, k, n, block):
    """W8A8 experts: the rows quantized as the dense layers' are (`quantization.quantize_rows`, by the experts'
    block), e4m3 x e4m3 summed in float32, against the float64 product of both dequantized operands."""
    from jaxserve.models.quantization import quantize_rows

    rng = np.random.default_rng(k + n + block)
    rows, values, scale, sizes, _ = _case(rng, group_sizes, extra_rows, k, n, block, jnp.float32)
    rows = rows * jnp.asarray(np.repeat(rng.uniform(0.01, 20, size=k // 16), 16), jnp.float32)  # uneven columns
    xq, row_scale = quantize_rows(rows, 0 if block >= k else block)
    got = kernel.grouped_matmul(xq, values, sizes, scale, block, row_scale, interpret=not _compiled(fp8=True))
    x = np.asarray(xq.astype(jnp.float32), np.float64) * np.repeat(np.asarray(row_scale, np.float64),
                                                                   k // row_scale.shape[1], axis=1)
    blocks = scale.shape[1]
    weights = (np.asarray(values.astype(jnp.float32), np.float64)
               * np.repeat(np.asarray(scale, np.float64), k // blocks, axis=1))
    want, exact, start = np.zeros((x.shape[0], n)), np.zeros((x.shape[0], n)), 0
    for group, size in enumerate(group_sizes):
        want[start:start + size] = x[start:start + size] @ weights[group]
        exact[start:start + size] = np.asarray(rows, np.float64)[start:start + size] @ weights[group]
        start += size
    assert (np.asarray(got)[sum(group_sizes):] == 0).all()
    tol = 2e-2 if _compiled(fp8=True) else 1e-5
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol * np.abs(want).max(), rtol=0)
    assert np.abs(np.asarray(got, np.float64) - exact).mean() < 0.05 * np.abs(exact).mean()  # e4m3's rounding
    with pytest.raises(ValueError):  # e4m3 rows need their scales
        kernel.grouped_matmul(xq, values, sizes, scale, block, interpret=True)
    # Contracted tiles of 16 take no e4m3 rows: Triton's 8-bit dots need 32 (Ada's e4m3 MMA is k32)
    assert kernel.fits(k, n, block, fp8_rows=True) and not kernel.fits(256, 96, 16, fp8_rows=True)
    assert kernel.fits(256, 96, 16) and not kernel.fits(48, 32, 48, fp8_rows=True)  # K of 48: tiles of 16


@pytest.mark.parametrize(("group_sizes", "block_t"), [([3, 0, 16, 17, 1], 16), ([0, 0, 0], 16), ([64, 1], 64),
                                                     ([1] * 6, 16)])
def test_every_tile_holds_one_expert_s_rows_and_every_row_one_tile(group_sizes, block_t):
    """The layout: each expert's rows cut into tiles of `block_t` in order, every row of every expert in exactly
    one tile of its own expert, the tiles past the ones in use empty; and never more tiles than rows."""
    num_rows = sum(group_sizes) + 2  # two rows past the groups
    layout = kernel._TileLayout.of(jnp.asarray(group_sizes, jnp.int32), num_rows, block_t)
    group, first, count = (np.asarray(a) for a in (layout.group, layout.first_row, layout.num_rows))
    used = [g for g, size in enumerate(group_sizes) for _ in range(-(-size // block_t))]
    assert len(used) <= len(group) <= num_rows
    assert group[: len(used)].tolist() == used and (count[len(used):] == 0).all()
    starts = np.cumsum([0, *group_sizes])
    covered = [row for tile in range(len(used)) for row in range(first[tile], first[tile] + count[tile])]
    assert covered == list(range(sum(group_sizes)))  # each row once, in order, none past the groups
    for tile in range(len(used)):
        assert 1 <= count[tile] <= block_t
        assert starts[group[tile]] <= first[tile] and first[tile] + count[tile] <= starts[group[tile] + 1]


@pytest.mark.parametrize(("rows", "groups", "k", "n", "block", "row_bytes", "value_bytes"), [
    (128, 128, 2048, 768, 0, 2, 2), (2048, 128, 2048, 768, 0, 2, 2), (512, 8, 4096, 14336, 0, 2, 2),  # bf16
    (2048, 8, 4096, 14336, 128, 4, 1), (512, 8, 14336, 4096, 14336, 4, 1),  # e4m3 under float32 rows
    (128, 32, 2880, 2880, 0, 2, 2), (64, 256, 7168, 256, 128, 2, 1)])
def test_tiles_divide_the_shapes_and_their_pipelined_loads_fit_shared_memory(rows, groups, k, n, block, row_bytes,
                                                                              value_bytes):
    block_t, block_n, block_k = kernel.tiles(rows, groups, k, n, block, row_bytes, value_bytes)
    assert 16 <= block_t <= 64 and n % block_n == 0 and k % block_k == 0 and min(block_n, block_k) >= 16
    if 0 < block < k:
        assert block_k == block  # a scale block is the contracted tile
    assert kernel.NUM_STAGES * (block_t * block_k * row_bytes + block_k * block_n * value_bytes) \
        <= kernel.SHARED_MEMORY_BUDGET


def test_cuda_gpus_from_sm80_take_the_kernel_for_16_bit_experts_and_from_sm89_for_fp8_ones(monkeypatch):
    monkeypatch.delenv("JAXSERVE_TRITON_EXPERTS", raising=False)
    h100, a100 = (AttentionConfig("pallas", compute_capability=c) for c in (9.0, 8.0))
    assert (h100.expert_kernel, h100.fp8_expert_kernel) == ("compiled", "compiled")
    assert AttentionConfig("pallas", compute_capability=9.0, mesh=object()).fp8_expert_kernel == "compiled"  # shard_map
    assert (a100.expert_kernel, a100.fp8_expert_kernel) == ("compiled", None)  # e4m3 widened by XLA
    assert AttentionConfig("pallas", compute_capability=7.5).expert_kernel is None
    assert AttentionConfig("interpret").expert_kernel == AttentionConfig("interpret").fp8_expert_kernel == "interpret"
    assert AttentionConfig("cpu").expert_kernel is None and AttentionConfig("cpu").fp8_expert_kernel is None
    monkeypatch.setenv("JAXSERVE_TRITON_EXPERTS", "0")  # both back on XLA's paths
    assert h100.expert_kernel is None and h100.fp8_expert_kernel is None
    assert kernel.fits(2048, 768, 2048) and kernel.fits(2048, 768, 128) and kernel.fits(2048, 768)
    assert kernel.fits(2880, 2880, 2880) and kernel.fits(2880, 2880)  # GPT-OSS: contracted tiles of 64
    assert not kernel.fits(7168, 2048, 24) and not kernel.fits(7000, 2048, 128)  # blocks Triton cannot take
    assert not kernel.fits(7168, 2048, 512)  # a block wider than a tile (its steps' loads would not fit)


@functools.cache
def _deviceless(target: str):
    from jaxserve.device import deviceless_device

    return deviceless_device(target)


def _triton_calls(compiled) -> int:  # the Pallas Triton kernels an XLA:GPU executable launches
    return sum(line.count("__gpu$xla.gpu.triton") for line in compiled.as_text().splitlines()
               if "custom-call(" in line)


@pytest.mark.parametrize(("target", "rows", "experts"), [
    ("h100", 128, "fp8 channel"), ("h100", 128, "fp8 blocks"), ("h100", 2048, "fp8 channel"),
    ("h100", 128, "bf16"), ("a100", 512, "bf16")])
def test_the_kernel_compiles_for_cuda_gpus_without_temporaries_the_experts_size(target, rows, experts):
    """Qwen3-30B-A3B's up projection (128 experts [2048, 768]) for decode steps of 16 and 64 tokens (128 and
    512 sorted rows) and a mixed one of 256, deviceless through Triton and ptxas for sm_90 or sm_80: the
    step's temporaries are the output (with its spare rows), where XLA's ragged dot over the same experts writes
    every row's product with every expert (f32[G, A, N]) and, with block scales, the widened experts (2 bytes
    a weight)."""
    from jaxserve.models.moe import grouped_matmul
    from jaxserve.models.quantization import Fp8Experts
    from jaxserve.parallel import on_one_device

    device = _deviceless(target)
    e, k, n = 128, 2048, 768
    struct = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=on_one_device(device))  # noqa: E731
    if experts == "bf16":
        w = struct((e, k, n), jnp.bfloat16)
    else:
        block = 128 if experts == "fp8 blocks" else k
        w = Fp8Experts(struct((e, k, n), jnp.float8_e4m3fn), struct((e, k // block, n), jnp.float32), block)
    args = (struct((rows, k), jnp.bfloat16), w, struct((e,), jnp.int32))
    compiled = {}
    for name, mode in (("kernel", "compiled"), ("xla", None)):
        with jax.default_device(device):
            compiled[name] = jax.jit(lambda x, w, sizes, m=mode: grouped_matmul(
                x, w, sizes, kernel=m, fp8_kernel=m)).trace(*args).lower().compile()
    assert _triton_calls(compiled["kernel"]) == 1 and _triton_calls(compiled["xla"]) == 0
    weights = e * k * n
    # the float32 products (and the kernel's spare rows), and the tile layout: nothing of the experts' size
    assert compiled["kernel"].memory_analysis().temp_size_in_bytes <= 2 * 4 * (rows + 64) * n + 2**20
    widened = 2 * weights if experts == "fp8 blocks" else 0
    assert compiled["xla"].memory_analysis().temp_size_in_bytes >= 4 * e * rows * n + widened


def test_fp8_experts_take_e4m3_rows_in_large_steps_where_the_kernel_s_dot_runs_on_fp8_tensor_cores(monkeypatch):
    """As block-scaled dense weights do (`AttentionConfig.fp8_block_activations`): Ada and the interpreter with FP8
    activations, from W8A8_MIN_ROWS tokens a step; Hopper only with JAXSERVE_FP8_ACTIVATIONS=1; under a mesh
    too (the experts' kernel runs under `shard_map`)."""
    from jaxserve.models.quantization import W8A8_MIN_ROWS, experts_in_fp8

    monkeypatch.delenv("JAXSERVE_FP8_ACTIVATIONS", raising=False)
    monkeypatch.delenv("JAXSERVE_TRITON_EXPERTS", raising=False)
    ada, hopper = (AttentionConfig("pallas", compute_capability=c) for c in (8.9, 9.0))
    assert experts_in_fp8(W8A8_MIN_ROWS, ada) and not experts_in_fp8(W8A8_MIN_ROWS - 1, ada)  # rows an expert
    assert experts_in_fp8(W8A8_MIN_ROWS, AttentionConfig("pallas", compute_capability=8.9, mesh=object()))
    assert not any(experts_in_fp8(W8A8_MIN_ROWS, a) for a in (hopper, AttentionConfig("interpret"), None))
    monkeypatch.setenv("JAXSERVE_FP8_ACTIVATIONS", "1")
    assert experts_in_fp8(W8A8_MIN_ROWS, hopper) and experts_in_fp8(W8A8_MIN_ROWS, AttentionConfig("interpret"))
    monkeypatch.setenv("JAXSERVE_TRITON_EXPERTS", "0")  # no kernel: XLA's paths, 16-bit rows
    assert not experts_in_fp8(W8A8_MIN_ROWS, ada)


def test_e4m3_rows_run_on_ada_s_fp8_tensor_cores():
    """Deviceless for an L40S, through Triton and ptxas: the kernel's dot over e4m3 rows and experts is Ada's
    e4m3 `mma.sync` (for Hopper's float16 MMAs instead, see `tests/ops/test_fp8_block_matmul.py`)."""
    from jaxserve.bench.ptxas import compiled_ptx, tensor_core_instructions
    from jaxserve.parallel import on_one_device

    device = _deviceless("l40s")
    e, k, n, rows = 128, 2048, 768, 2048
    struct = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=on_one_device(device))  # noqa: E731
    args = (struct((rows, k), jnp.float8_e4m3fn), struct((e, k, n), jnp.float8_e4m3fn), struct((e,), jnp.int32),
            struct((e, k // 128, n), jnp.float32), struct((rows, k // 128), jnp.float32))
    with jax.default_device(device):
        ptx = compiled_ptx(jax.jit(lambda x, v, sizes, s, xs: kernel.grouped_matmul(x, v, sizes, s, 128, xs)).trace(
            *args).lower())
    assert set(tensor_core_instructions(ptx)) == {"mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32"}


@pytest.mark.slow
def test_an_fp8_mixture_with_e4m3_rows_tracks_its_16_bit_rows(tiny_model_dir, tmp_path, monkeypatch):
    """Ada's large steps, interpreted (JAXSERVE_FP8_ACTIVATIONS=1, W8A8_MIN_ROWS made 1 row an expert): each
    mixture layer's gate and up products take rows in e4m3 (down's are too narrow: Triton's 8-bit dots need
    32 contracted rows), and the logits stay near the same experts' with 16-bit rows, nearer than the weights'
    rounding put them from the 32-bit model. (Block scales' e4m3 rows: the oracle test above; this model's
    experts are too narrow for blocks of 32.)"""
    from tests.models.test_quantization import _write_fp8_checkpoint, fp8_rows_logits

    _write_fp8_checkpoint(tiny_model_dir("qwen3-moe"), tmp_path / "fp8", fmt="compressed-tensors")
    logits, rows, original = fp8_rows_logits(tmp_path / "fp8", tiny_model_dir("qwen3-moe"), kernel, "grouped_matmul", 1,
                                             monkeypatch)
    # gate and up [6, 64, 48]; down [6, 48, 64], whose K of 48 takes contracted tiles of 16: 16-bit rows
    assert rows == {"0": ["float32"] * 3, "1": ["float8_e4m3fn"] * 2 + ["float32"]}
    rows_error = np.abs(logits["1"] - logits["0"]).mean() / np.abs(logits["0"]).mean()
    weights_error = np.abs(logits["0"] - original).mean() / np.abs(original).mean()
    assert 0 < rows_error < weights_error


@pytest.mark.slow
@pytest.mark.parametrize("block", [None, (16, 16)], ids=["per channel", "blocks of 16"])
def test_an_fp8_mixture_computes_through_the_kernel_what_it_computes_through_xla(block, tiny_model_dir, tmp_path,
                                                                                 monkeypatch):
    """Qwen3-MoE's FP8 checkpoint (6 experts [64, 48] a layer): with the interpreted kernels each mixture
    layer's three grouped products go through the kernel, and the model computes what it computes through XLA
    over the widened experts."""
    from jaxserve.models.loader import load_model
    from tests.models.test_parity import PagedForward
    from tests.models.test_quantization import _write_fp8_checkpoint

    _write_fp8_checkpoint(tiny_model_dir("qwen3-moe"), tmp_path / "fp8", block=block,
                          fmt="fp8" if block else "compressed-tensors")
    jax.clear_caches()  # a layer traced before in this process would not be traced again
    calls = []
    monkeypatch.setattr(kernel, "grouped_matmul",
                        lambda *a, _run=kernel.grouped_matmul, **kw: calls.append(a[1].shape) or _run(*a, **kw))
    tokens = list(range(200, 213))
    logits = {impl: PagedForward(load_model(str(tmp_path / "fp8"), dtype="float32", attention_impl=impl),
                                 list(range(1, 9)))(tokens)
              for impl in ("interpret", "cpu")}
    # gate, up and down: the two mixture layers (0 and 2) are traced once (`layers.apply_layers`)
    assert sorted(calls) == sorted([(6, 64, 48), (6, 64, 48), (6, 48, 64)])
    np.testing.assert_allclose(logits["interpret"], logits["cpu"], atol=2e-4, rtol=0)


@pytest.mark.slow
def test_bfloat16_experts_compute_through_the_kernel_what_they_compute_through_xla(tiny_model_dir, monkeypatch):
    """Qwen3-MoE with bfloat16 weights (a float32 model otherwise) and the interpreted kernels: each mixture
    layer's three grouped products go through the kernel (16-bit experts, no scales), and the logits are XLA's
    ragged dot's to bfloat16's rounding (the same products summed in another order, the rows rounded to
    bfloat16 before each product)."""
    from jaxserve.models.loader import load_model
    from tests.models.test_parity import PagedForward

    jax.clear_caches()
    calls = []
    monkeypatch.setattr(kernel, "grouped_matmul",
                        lambda *a, _run=kernel.grouped_matmul, **kw: calls.append(a[1].dtype) or _run(*a, **kw))
    tokens = list(range(200, 213))
    logits = {impl: PagedForward(load_model(str(tiny_model_dir("qwen3-moe")), dtype="float32",
                                            weight_dtype="bfloat16", attention_impl=impl), list(range(1, 9)))(tokens)
              for impl in ("interpret", "cpu")}
    assert calls == [jnp.bfloat16] * 3
    scale = np.abs(logits["cpu"]).max()
    np.testing.assert_allclose(logits["interpret"], logits["cpu"], atol=0.03 * scale, rtol=0)
    assert (logits["interpret"].argmax(-1) == logits["cpu"].argmax(-1)).mean() >= 0.9
