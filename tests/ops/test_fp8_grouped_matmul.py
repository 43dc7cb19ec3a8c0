"""The FP8 experts' grouped matmul kernel (`ops.fp8_grouped_matmul`) against a float64 oracle: compiled on a
CUDA GPU that has it, interpreted elsewhere; its tile layout; its compile for an H100 (through Triton and
ptxas), which reads the experts once where XLA's ragged dot writes a widened copy of all of them; and a
mixture whose checkpoint stores its experts in e4m3 computing through it what it computes through XLA."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.ops import fp8_grouped_matmul as kernel
from jaxserve.ops.attention import AttentionConfig, cuda_compute_capability, resolve_impl
from jaxserve.ops.fp8_block_matmul import MIN_COMPUTE_CAPABILITY, TRITON_BACKEND

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not TRITON_BACKEND, reason="this jax has no Pallas Triton")]

COMPILED = resolve_impl("auto") == "pallas" and (cuda_compute_capability() or 0) >= MIN_COMPUTE_CAPABILITY


def _case(rng: np.random.Generator, group_sizes: list[int], extra_rows: int, k: int, n: int, block: int, dtype):
    """Sorted rows (with `extra_rows` past the groups), e4m3 experts, their scales, and the float64 oracle."""
    num_groups, num_rows = len(group_sizes), sum(group_sizes) + extra_rows
    rows = jnp.asarray(rng.normal(size=(num_rows, k)), dtype)
    values = jnp.asarray(rng.normal(size=(num_groups, k, n)) * 60, jnp.float32).astype(jnp.float8_e4m3fn)
    blocks = 1 if block >= k else k // block
    scale = jnp.asarray(rng.uniform(1e-3, 1.0, size=(num_groups, blocks, n)), jnp.float32)
    weights = (np.asarray(values.astype(jnp.float32), np.float64)
               * np.repeat(np.asarray(scale, np.float64), k // blocks, axis=1))  # [G, K, N]
    x = np.asarray(rows.astype(jnp.float32), np.float64)
    want, start = np.zeros((num_rows, n)), 0
    for group, size in enumerate(group_sizes):
        want[start:start + size] = x[start:start + size] @ weights[group]
        start += size
    return rows, values, scale, jnp.asarray(group_sizes, jnp.int32), want


@pytest.mark.parametrize(("group_sizes", "extra_rows", "k", "n", "block"), [
    ([1, 0, 2, 1, 0, 0, 3, 1], 0, 256, 96, 256),  # a decode step: a row or two an expert, some none; per channel
    ([1, 0, 2, 1, 0, 0, 3, 1], 0, 256, 96, 64),  # the same with block scales
    ([40, 3, 0, 17], 4, 128, 64, 32),  # tiles of 16 over experts of 40 and 17 rows; rows past the groups
    ([70, 90], 0, 64, 48, 64),  # tiles of 64 (80 rows an expert on average), 48 outputs in tiles of 16
    ([0, 0, 5], 3, 48, 32, 48),  # K of 48: contracted tiles of 16
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_kernel_matches_the_float64_oracle(group_sizes, extra_rows, k, n, block, dtype):
    rows, values, scale, sizes, want = _case(np.random.default_rng(k + n), group_sizes, extra_rows, k, n, block,
                                             dtype)
    got = kernel.fp8_grouped_matmul(rows, values, scale, block, sizes, interpret=not COMPILED)
    assert got.shape == want.shape and got.dtype == jnp.float32
    assert (np.asarray(got)[sum(group_sizes):] == 0).all()  # rows past the groups
    tol = 1e-5 if dtype == jnp.float32 and not COMPILED else 2e-2  # bfloat16 rows; a GPU's TF32 dots
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize(("group_sizes", "block_t"), [([3, 0, 16, 17, 1], 16), ([0, 0, 0], 16), ([64, 1], 64)])
def test_every_tile_holds_one_expert_s_rows_and_every_row_one_place(group_sizes, block_t):
    """The padded layout: each expert's rows in whole tiles of its own, in order; zero rows in the padding and
    the tiles past the ones in use marked past the experts."""
    num_rows = sum(group_sizes) + 2
    layout = kernel._TileLayout.of(jnp.asarray(group_sizes, jnp.int32), num_rows, block_t)
    tile_group, source = np.asarray(layout.tile_group), np.asarray(layout.source_row)
    assert len(tile_group) == min(num_rows, num_rows // block_t + min(len(group_sizes), num_rows))
    used = [g for g, size in enumerate(group_sizes) for _ in range(-(-size // block_t))]
    assert tile_group.tolist() == used + [len(group_sizes)] * (len(tile_group) - len(used))
    position = np.asarray(layout.position)[: sum(group_sizes)]
    assert (source[position] == np.arange(sum(group_sizes))).all()  # each row where the gather back reads it
    assert sorted(source[source < num_rows].tolist()) == list(range(sum(group_sizes)))  # once each
    starts = np.cumsum([0, *group_sizes])
    for tile, group in enumerate(tile_group[: len(used)]):
        rows = source[tile * block_t:(tile + 1) * block_t]
        assert all(starts[group] <= r < starts[group + 1] for r in rows[rows < num_rows])
    assert not np.asarray(layout.covered)[sum(group_sizes):].any()


def test_only_gpus_that_convert_e4m3_and_the_interpreter_take_the_kernel():
    assert AttentionConfig("pallas", compute_capability=9.0).fp8_kernels == "compiled"
    assert AttentionConfig("pallas", compute_capability=9.0, mesh=object()).fp8_kernels == "compiled"  # shard_map
    assert AttentionConfig("pallas", compute_capability=8.0).fp8_kernels is None  # an A100: XLA
    assert AttentionConfig("interpret").fp8_kernels == "interpret"
    assert AttentionConfig("cpu").fp8_kernels is None
    assert kernel.fits(2048, 2048, 768, 2048) and not kernel.fits(2049, 2048, 768, 2048)
    assert kernel.fits(16, 2880, 2880, 2880)  # GPT-OSS: contracted tiles of 64
    assert not kernel.fits(16, 7168, 2048, 24) and not kernel.fits(16, 7000, 2048, 128)  # blocks Triton cannot take


@functools.cache
def _h100():
    from jaxserve.device import deviceless_device

    return deviceless_device("h100")


def _triton_calls(compiled) -> int:  # the Pallas Triton kernels an XLA:GPU executable launches
    return sum(line.count("__gpu$xla.gpu.triton") for line in compiled.as_text().splitlines()
               if "custom-call(" in line)


@pytest.mark.parametrize(("rows", "block"), [(128, 0), (128, 128), (2048, 0)])
def test_the_kernel_compiles_for_an_h100_without_a_widened_copy_of_the_experts(rows, block):
    """Qwen3-30B-A3B's up projection (128 experts [2048, 768]) for a decode step of 16 tokens (128 sorted rows)
    and a mixed one of 256, deviceless through Triton and ptxas for sm_90: the step's temporaries are the
    padded rows and products, where XLA's ragged dot over the same experts writes every row's product with
    every expert (f32[G, A, N]) and, with block scales, the widened experts (2 bytes a weight)."""
    from jaxserve.models.moe import grouped_matmul
    from jaxserve.models.quantization import Fp8Experts
    from jaxserve.parallel import on_one_device

    sharding = on_one_device(_h100())
    e, k, n = 128, 2048, 768
    blocks = k // block if block else 1
    struct = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    args = (struct((rows, k), jnp.bfloat16),
            Fp8Experts(struct((e, k, n), jnp.float8_e4m3fn), struct((e, blocks, n), jnp.float32), block or k),
            struct((e,), jnp.int32))
    compiled = {}
    for name, mode in (("kernel", "compiled"), ("xla", None)):
        with jax.default_device(_h100()):
            compiled[name] = jax.jit(lambda x, w, sizes, m=mode: grouped_matmul(x, w, sizes, fp8_kernel=m)).trace(
                *args).lower().compile()
    assert _triton_calls(compiled["kernel"]) == 1 and _triton_calls(compiled["xla"]) == 0
    weights, padded_rows = e * k * n, rows + e * 16  # at most a partial tile of 16 rows an expert
    # the padded rows (bfloat16) and their float32 products, gathered: nothing the experts' size
    assert compiled["kernel"].memory_analysis().temp_size_in_bytes <= 2 * padded_rows * (2 * k + 4 * n)
    assert compiled["xla"].memory_analysis().temp_size_in_bytes >= 4 * e * rows * n + (2 * weights if block else 0)


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
    monkeypatch.setattr(kernel, "fp8_grouped_matmul",
                        lambda *a, _run=kernel.fp8_grouped_matmul, **kw: calls.append(a[1].shape) or _run(*a, **kw))
    tokens = list(range(200, 213))
    logits = {impl: PagedForward(load_model(str(tmp_path / "fp8"), dtype="float32", attention_impl=impl),
                                 list(range(1, 9)))(tokens)
              for impl in ("interpret", "cpu")}
    # gate, up and down: the two mixture layers (0 and 2) are traced once (`layers.apply_layers`)
    assert sorted(calls) == sorted([(6, 64, 48), (6, 64, 48), (6, 48, 64)])
    np.testing.assert_allclose(logits["interpret"], logits["cpu"], atol=2e-4, rtol=0)
