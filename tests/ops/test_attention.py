"""The attention paths that run on CPU (the reference, the jnp CPU path and the native decode kernel)
against a float64 numpy oracle, and the impl choice."""

import dataclasses
import shutil
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxserve.device import local_facts, target_facts
from jaxserve.ops import cpu_kernels
from jaxserve.ops.attention import (
    MIN_PALLAS_COMPUTE_CAPABILITY,
    AttentionConfig,
    cuda_compute_capability,
    ragged_paged_attention,
    resolve_attention,
    resolve_impl,
)
from jaxserve.ops.paged_attention_cpu import num_work_items, ragged_paged_attention_cpu
from tests.helpers import pairwise, run_jitted, run_with_kernel_flags, skip_a_build_like_the_suite_s
from tests.ops.paged_cases import MIXES, make_case, oracle


def assert_matches_oracle(got: np.ndarray, case, scale: float) -> None:
    want = oracle(case, scale)
    num_real = case.num_real_tokens
    np.testing.assert_allclose(got[:num_real], want[:num_real], atol=2e-5, rtol=1e-5)
    assert np.all(got[num_real:] == 0), "padding tokens must come back as zeros"
    assert np.all(np.isfinite(got))


NATIVE = cpu_kernels.kernel_error() is None
# The jnp path for XLA:CPU and the native kernel, at a CPU's float32 tolerance (the Pallas kernels and the
# reference on a GPU: test_paged_attention_pallas.py).
cpu_paths = pytest.mark.cpu_only("the attention paths for CPUs")
needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="no C++ compiler: the native kernels cannot be built here")
native = pytest.param("cpu-native", marks=pytest.mark.skipif(not NATIVE, reason="native kernels unavailable"))


@cpu_paths
@pytest.mark.parametrize("impl", ["reference", "cpu", native])
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (6, 2), (8, 2), (3, 1)])
def test_cpu_paths_match_oracle(impl, mix, num_q_heads, num_kv_heads):
    rng = np.random.default_rng(sorted(MIXES).index(mix))
    case = make_case(rng, *MIXES[mix], num_q_heads, num_kv_heads)
    got = np.asarray(run_jitted(ragged_paged_attention, *case.args, sm_scale=0.25, impl=impl))
    assert_matches_oracle(got, case, 0.25)


@pytest.mark.parametrize("decode_only", [False, True])
@pytest.mark.parametrize("num_q_heads", [16, 64])
def test_wide_heads_in_the_triton_kernels_smaller_blocks_match_the_oracle(decode_only, num_q_heads):
    """DeepSeek's latent attention (576 dims, padded to 1,024; all heads on one KV head) at the Triton kernels'
    wide-head settings, in interpret mode: a group of 64 in two calls of 32 heads. (At the default blocks its
    576-dim heads asked an H100 for 297 KB of shared memory; tests/test_compile_ladder.py compiles these.)"""
    from jaxserve.ops import paged_attention_pallas as pallas

    assert pallas.block_settings(256, decode_only) == {} and pallas.block_settings(2048, decode_only) is None
    assert pallas.block_settings(576, decode_only) == (pallas.WIDE_DECODE if decode_only else pallas.WIDE_RAGGED)
    q_lens, kv_lens = ([1, 1, 1], [5, 40, 9]) if decode_only else ([1, 7, 0, 3], [9, 40, 0, 3])
    pads = dict(pad_tokens=0, pad_reqs=0) if decode_only else {}
    case = make_case(np.random.default_rng(3), q_lens, kv_lens, num_q_heads, 1, head_dim=576, **pads)
    got = np.asarray(run_jitted(ragged_paged_attention, *case.args, sm_scale=0.25, impl="interpret",
                                decode_only=decode_only))
    assert_matches_oracle(got, case, 0.25)


@pytest.mark.parametrize("value_dims", [None, 512, 500])
@pytest.mark.parametrize("decode_only", [False, True])
@pytest.mark.parametrize("impl", [pytest.param("reference", marks=cpu_paths), pytest.param("cpu", marks=cpu_paths),
                                  pytest.param(native.values[0], marks=[*native.marks, cpu_paths]), "interpret"])
def test_a_cache_of_keys_alone_reads_its_keys_as_values(impl, decode_only, value_dims):
    """v_pages None (DeepSeek's latent cache: one KV head of 576 dims, 16 query heads): every path attends as
    if the keys' pages were also the values', the Triton kernels (interpreted) loading each block once. With
    `value_dims` the values are the keys' first dims and the output that wide: 512 (the latent; then 64 RoPE
    dims) splits the Triton kernels' head into two pieces (`HeadPieces`), 500 does not split."""
    from jaxserve.ops.paged_attention_pallas import HeadPieces

    assert HeadPieces.of(576, 512, values_are_keys=True).pieces == ((0, 512), (512, 64))
    assert HeadPieces.of(576, 500, values_are_keys=True).pieces == ((0, 576),)
    q_lens, kv_lens = ([1, 1, 1], [5, 40, 9]) if decode_only else ([1, 7, 0, 3], [9, 40, 0, 3])
    pads = dict(pad_tokens=0, pad_reqs=0) if decode_only else {}
    case = make_case(np.random.default_rng(5), q_lens, kv_lens, 16, 1, head_dim=576, **pads)
    case = dataclasses.replace(case, v_pages=case.k_pages)
    q, k_pages, _, *rest = case.args
    got = np.asarray(run_jitted(ragged_paged_attention, q, k_pages, None, *rest, sm_scale=0.25, impl=impl,
                                decode_only=decode_only, value_dims=value_dims))
    assert got.shape == (*q.shape[:2], value_dims or 576)
    want = oracle(case, 0.25)[..., :value_dims]
    num_real = case.num_real_tokens
    np.testing.assert_allclose(got[:num_real], want[:num_real], atol=2e-5, rtol=1e-5)
    assert np.all(got[num_real:] == 0), "padding tokens must come back as zeros"


def test_group_parts_put_back_each_head_s_values_at_any_token_count():
    """`in_group_parts` splits 64 heads on one KV head into calls of 32 and puts their outputs (as wide as the
    values: 512 of 576 dims here) back in the heads' order, at zero tokens too."""
    from jaxserve.ops.head_groups import in_group_parts

    for num_tokens in (0, 3):
        q = jax.numpy.arange(num_tokens * 64 * 576, dtype=np.float32).reshape(num_tokens, 64, 576)
        out = in_group_parts(lambda part, sinks: part[..., :512] * 2.0, q, 1, 32)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(q[..., :512]) * 2.0)


@cpu_paths
@pytest.mark.skipif(not NATIVE, reason="native kernels unavailable here")
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("value_dims", [512, 500, None], ids=["latent 512 (compiled)", "500", "whole head"])
@pytest.mark.parametrize(("q_lens", "kv_lens", "scores"), [
    ([1], [300], {}),  # one decode: one unit, whose 16 heads split in ranges so that every thread works
    ([1], [70], {"sliding_window": 29, "sinks": np.linspace(-6.0, 4.0, 16, dtype=np.float32)}),  # ranges' heads
    ([1, 1, 1], [1, 64, 200], {}),  # as many units as threads or more: whole groups
    ([37, 1], [200, 45], {}),  # a chunk after cached tokens: units of 4 tokens x 16 heads, the blocked loops
], ids=["one decode", "one decode, window and sinks", "decodes", "chunk and decode"])
def test_the_native_kernel_reads_deepseek_s_latent_once(q_lens, kv_lens, scores, value_dims, cache_dtype):
    """DeepSeek's latent cache (one KV head of 576 dims for 16 query heads, keys alone): the native kernel reads
    each block of keys once as keys and values, sums only the values' dims (the first 512, whose loops are
    compiled, or any other count), and splits a call of fewer units than threads by heads; against the float64
    oracle on the cache's own values, over many pages and runs of 64 keys."""
    check_the_latent(q_lens, kv_lens, scores, value_dims, cache_dtype)


@cpu_paths
@pytest.mark.skipif(not NATIVE, reason="native kernels unavailable here")
@pytest.mark.parametrize("num_q_heads", [16, 40, 64])
def test_a_decode_over_the_latent_is_the_same_alone_and_batched(num_q_heads):
    """Alone, a decode's unit is split by heads over the threads; beside another decode it is not. The ranges are
    whole blocks of 8 heads, so each head's scores are summed in the same loops either way: bitwise the same
    output (40 heads split as 20 and 20 summed heads 16-19 and 36-39 one way and the other)."""
    rng = np.random.default_rng(num_q_heads)
    k_pages = rng.standard_normal((1, 40, 16, 576)).astype(np.float32)
    q = rng.standard_normal((2, num_q_heads, 576)).astype(np.float32)
    table = np.arange(40, dtype=np.int32).reshape(2, 20)

    def attend(q, kv_lens, table, cu_q_lens):
        return np.asarray(jax.jit(lambda *a: cpu_kernels.ragged_paged_attention(
            *a, sm_scale=0.05, value_dims=512))(q, k_pages, None, kv_lens, table, cu_q_lens))

    alone = attend(q[:1], np.array([300], np.int32), table[:1], np.array([0, 1], np.int32))
    batched = attend(q, np.array([300, 300], np.int32), table, np.array([0, 1, 2], np.int32))
    np.testing.assert_array_equal(alone[0], batched[0])


def check_the_latent(q_lens: list[int], kv_lens: list[int], scores: dict, value_dims: int | None,
                     cache_dtype: str) -> None:
    import ml_dtypes

    case = make_case(np.random.default_rng(len(q_lens) + kv_lens[0]), q_lens, kv_lens, 16, 1, page_size=16,
                     head_dim=576, pad_tokens=2, pad_reqs=1, max_pages=20)
    k_pages = case.k_pages.astype(ml_dtypes.bfloat16) if cache_dtype == "bfloat16" else case.k_pages
    case = dataclasses.replace(case, k_pages=k_pages.astype(np.float32), v_pages=k_pages.astype(np.float32))
    got = np.asarray(jax.jit(lambda q, k, *a: cpu_kernels.ragged_paged_attention(
        q, k, None, *a, sm_scale=0.05, value_dims=value_dims, **scores))(case.q, k_pages, *case.args[3:]))
    assert got.shape == (*case.q.shape[:2], value_dims or 576)
    want = oracle(case, 0.05, **scores)[..., :value_dims]
    real = case.num_real_tokens
    np.testing.assert_allclose(got[:real], want[:real], atol=2e-5, rtol=1e-5)
    assert np.all(got[real:] == 0), "padding tokens must come back as zeros"


@cpu_paths
@pytest.mark.parametrize(("query_block", "mix", "pages_per_block"), pairwise(
    [1, 2, 3, 8, 64], ["prefills", "chunk_after_cache", "mixed_with_empty", "long"], [1, 3, 8]))
def test_cpu_work_items_of_any_size_match_oracle(query_block, mix, pages_per_block):
    """Items that split requests mid-page, straddle K/V block edges, or hold a whole request; requests with
    no queries and padding requests (NaN pages outside what each request owns would show any overreach)."""
    case = make_case(np.random.default_rng(7), *MIXES[mix], 6, 2)
    got = np.asarray(run_jitted(ragged_paged_attention_cpu, *case.args, sm_scale=0.25, query_block=query_block,
                                pages_per_block=pages_per_block))
    assert_matches_oracle(got, case, 0.25)


@needs_compiler
def test_the_native_kernels_build_on_a_machine_with_a_compiler():
    assert cpu_kernels.kernel_error() is None


@cpu_paths
@pytest.mark.parametrize("impl", ["cpu", native])
def test_cpu_decode_paths_match_oracle(impl):
    """decode_only: one item per request (token r is request r's query), padding requests with kv_len 0."""
    rng = np.random.default_rng(3)
    q_lens, kv_lens = [1] * 5, [1, 16, 17, 33, 47]
    case = make_case(rng, q_lens, kv_lens, 9, 3, pad_tokens=2, pad_reqs=2)
    got = np.asarray(run_jitted(ragged_paged_attention, *case.args, sm_scale=0.125, impl=impl, decode_only=True))
    assert_matches_oracle(got, case, 0.125)


HEAD_DIMS = [16, 64, 128]  # 64 and 128 have compiled-in loop bounds (the blocked loops of prefill units)
# 128: runs of 64 keys; 128 query heads on 1 (DeepSeek's latent attention): a group of two units' rows
UNIT_SHAPES = [(4, 6, 2), (16, 9, 3), (8, 4, 4), (32, 16, 1), (128, 9, 3), (4, 128, 1)]


@cpu_paths
@pytest.mark.skipif(not NATIVE, reason="native kernels unavailable here")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("page_size,num_q_heads,num_kv_heads", UNIT_SHAPES)
def test_native_kernel_matches_oracle_on_units_of_every_shape(head_dim, page_size, num_q_heads, num_kv_heads):
    check_units_of_every_shape(head_dim, page_size, num_q_heads, num_kv_heads)


def check_units_of_every_shape(head_dim: int, page_size: int, num_q_heads: int, num_kv_heads: int) -> None:
    """Decodes with contexts on and off page edges; chunks longer than one unit (64 rows / group tokens) that
    start mid-page after cached tokens; a whole prompt; empty requests and padding. Every slot a request
    does not own is NaN, so reading past a request's length or outside its pages would show."""
    rng = np.random.default_rng(head_dim + page_size)
    q_lens = [1, 1, 1, 1, 70, 0, 23, 1]
    kv_lens = [1, page_size, page_size + 1, 3 * page_size - 1, 75, 0, 23, 70]
    case = make_case(rng, q_lens, kv_lens, num_q_heads, num_kv_heads, page_size=page_size, head_dim=head_dim,
                     pad_tokens=3, pad_reqs=3, max_pages=-(-75 // page_size) + 2)
    got = np.asarray(jax.jit(lambda *a: cpu_kernels.ragged_paged_attention(*a, sm_scale=0.3))(*case.args))
    assert_matches_oracle(got, case, 0.3)


@cpu_paths
@needs_compiler
@pytest.mark.slow
@pytest.mark.parametrize("flags", ["-mno-avx512f", "-mno-avx"], ids=["8 lanes (AVX2)", "4 lanes (no AVX)"])
def test_the_native_kernel_built_for_narrower_vectors_matches_too(flags):
    """The blocked loops' tiles follow the build's vector registers (16 lanes with AVX-512, 8 with AVX, else
    4): built without AVX-512 and without AVX, in a process of its own (the library loads once per process),
    every unit shape against the oracle, and DeepSeek's latent."""
    skip_a_build_like_the_suite_s(flags)
    script = """
        from tests.ops.test_attention import HEAD_DIMS, UNIT_SHAPES, check_the_latent, check_units_of_every_shape
        for head_dim in HEAD_DIMS:
            for shape in UNIT_SHAPES:
                check_units_of_every_shape(head_dim, *shape)
        for q_lens, kv_lens in (([1], [300]), ([37, 1], [200, 45])):  # DeepSeek's latent: its 512 values' tiles
            check_the_latent(q_lens, kv_lens, {}, 512, "bfloat16")
        print("ok")
    """
    result = run_with_kernel_flags(script, flags)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


@cpu_paths
@pytest.mark.skipif(not NATIVE, reason="native kernels unavailable here")
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("query_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_native_kernel_reads_a_16_bit_cache(cache_dtype, query_dtype, head_dim):
    """A 16-bit cache is read as stored, under float32 or bfloat16 queries (the output takes the queries'
    dtype); against the oracle on the cache's own values, so only the queries' and output's rounding
    remain (none in float32)."""
    import ml_dtypes

    case = make_case(np.random.default_rng(11), [1, 1, 9, 1], [3, 16, 40, 65], 9, 3, page_size=16,
                     head_dim=head_dim, pad_tokens=1, pad_reqs=1, max_pages=6)
    q, k_pages, v_pages, kv, table, cu = case.args
    q = q.astype(ml_dtypes.bfloat16) if query_dtype == "bfloat16" else q
    k_pages, v_pages = (x.astype(getattr(ml_dtypes, cache_dtype, np.float16)) for x in (k_pages, v_pages))
    want = oracle(type(case)(*[x.astype(np.float32) for x in (q, k_pages, v_pages)], kv, table, cu), 0.125)
    got = cpu_kernels.ragged_paged_attention(q, k_pages, v_pages, kv, table, cu, sm_scale=0.125)
    assert got.dtype == q.dtype
    got, real = np.asarray(got, np.float32), case.num_real_tokens
    tolerance = 2e-2 if query_dtype == "bfloat16" else 2e-5
    np.testing.assert_allclose(got[:real], want[:real], atol=tolerance, rtol=tolerance)
    assert np.all(got[real:] == 0)


@pytest.mark.skipif(not NATIVE, reason="native kernels unavailable here")
def test_loading_the_kernels_leaves_denormals_alone():
    """A -ffast-math link would bring GCC's crtfastmath.o, which turns on flush-to-zero for the thread that
    loads the library (this one: the module loaded it at import), changing numpy's and XLA's arithmetic."""
    assert cpu_kernels.kernel_error() is None
    assert np.float32(1e-38) / np.float32(1000) > 0, "denormals are flushed to zero"


@cpu_paths
@pytest.mark.skipif(not NATIVE, reason="native kernels unavailable here")
@pytest.mark.parametrize("breakage", ["page id", "too many pages", "kv_len < q_len", "cu_q_lens decreasing"])
def test_the_native_kernel_refuses_metadata_out_of_range(breakage):
    """A bad batch is an error the engine can report, never a read out of bounds."""
    case = make_case(np.random.default_rng(2), [1, 3], [5, 9], 6, 2, pad_tokens=0, pad_reqs=0, max_pages=3)
    q, k_pages, v_pages, kv, table, cu = (np.array(x) for x in case.args)
    if breakage == "page id":
        table[1, 1] = k_pages.shape[1]
    elif breakage == "too many pages":
        kv[1] = 4 * 3 + 1
    elif breakage == "kv_len < q_len":
        kv[1] = 2
    else:
        cu[1] = cu[2] + 1
    with pytest.raises(Exception, match="metadata out of range"):
        jax.block_until_ready(cpu_kernels.ragged_paged_attention(q, k_pages, v_pages, kv, table, cu, sm_scale=0.3))


def test_the_kv_cache_dtype_follows_the_model_and_the_kernel_keeps_it():
    from jaxserve.ops.attention import kv_cache_dtype

    assert kv_cache_dtype("auto", jax.numpy.bfloat16, "pallas") == jax.numpy.bfloat16
    assert kv_cache_dtype("float16", jax.numpy.float32, "cpu-native") == jax.numpy.float16
    with pytest.raises(ValueError, match="attention impl 'pallas' needs"):
        kv_cache_dtype("float16", jax.numpy.float32, "pallas")


def test_cpu_native_is_for_cpus():
    gpu = local_facts(SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="x"))
    with pytest.raises(ValueError, match="runs on CPUs, not on gpu"):
        resolve_impl("cpu-native", gpu)


def test_without_the_kernels_auto_keeps_the_jnp_path_and_cpu_native_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "kernel_error", lambda: "no C++ compiler found")
    cpu = local_facts(jax.devices("cpu")[0])
    assert resolve_impl("auto", cpu) == "cpu"
    with pytest.raises(ValueError, match="'cpu-native' is unavailable here: no C\\+\\+ compiler found"):
        resolve_impl("cpu-native", cpu)


def test_work_item_count_covers_every_split():
    # 40 tokens in blocks of 16 from 3 requests: at most 3 whole blocks plus one partial per request.
    assert num_work_items(40, 3, 16) == 6
    assert num_work_items(8, 8, 1) == 8


def test_auto_fits_this_machine_and_bad_choices_are_rejected():
    capability = cuda_compute_capability()
    kernel_runs = capability is not None and capability >= MIN_PALLAS_COMPUTE_CAPABILITY
    assert resolve_impl("auto") == ("pallas" if kernel_runs else "cpu-native" if NATIVE else "cpu")
    assert resolve_impl("cpu") == "cpu" and resolve_impl("reference") == "reference"
    assert resolve_impl("interpret") == "interpret"
    with pytest.raises(ValueError, match="unknown attention impl"):
        resolve_impl("flash")
    if kernel_runs:
        assert resolve_impl("pallas") == "pallas"
    else:
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            resolve_impl("pallas")


@pytest.mark.parametrize(
    "platform,capability,want",
    [("gpu", "9.0", "pallas"), ("gpu", "8.0", "pallas"), ("gpu", "7.5", "reference"),
     ("gpu", "gfx942", "reference"), ("cpu", None, "cpu-native" if NATIVE else "cpu")],
)
def test_auto_picks_the_kernel_on_cuda_sm80_and_newer(platform, capability, want):
    device = local_facts(SimpleNamespace(platform=platform, compute_capability=capability, device_kind="x"))
    assert resolve_impl("auto", device) == want
    if want == "pallas":
        assert resolve_impl("pallas", device) == "pallas"
    else:
        with pytest.raises(ValueError, match=r"compute capability|no CUDA GPU"):
            resolve_impl("pallas", device)


@pytest.mark.parametrize("target,num_sms,capability", [("h100", 132, 9.0), ("a100", 108, 8.0)])
def test_a_gpu_target_resolves_as_that_gpu_would_here_on_a_cpu(target, num_sms, capability):
    """Compiling for a target picks what a real device of its kind picks, not what this CPU would."""
    attention = resolve_attention("auto", target_facts(target))
    assert attention == AttentionConfig(impl="pallas", num_sms=num_sms, compute_capability=capability)
    assert resolve_attention("auto", local_facts(jax.devices("cpu")[0])).impl in ("cpu", "cpu-native")


@pytest.fixture
def without_triton(monkeypatch):
    """This jax as one without Pallas' Triton backend would be (deprecated since jax 0.11)."""
    from jaxserve.ops import attention, paged_attention_pallas

    monkeypatch.setattr(paged_attention_pallas, "TRITON_BACKEND", False)
    attention._warn_kernels_missing.cache_clear()
    yield
    attention._warn_kernels_missing.cache_clear()


@pytest.mark.parametrize("capability", ["8.0", "8.9", "9.0", "10.0"])
def test_without_triton_s_backend_hopper_keeps_its_kernel_and_other_gpus_get_xla(capability, without_triton, caplog):
    facts = local_facts(SimpleNamespace(platform="gpu", compute_capability=capability, device_kind="x"))
    hopper = capability == "9.0"
    with caplog.at_level("WARNING", logger="jaxserve.ops.attention"):
        assert resolve_impl("auto", facts) == ("pallas" if hopper else "reference")
        resolve_impl("auto", facts)
    warnings = [r.getMessage() for r in caplog.records]
    if hopper:
        assert resolve_impl("pallas", facts) == "pallas" and not warnings
    else:
        assert len(warnings) == 1 and "no Pallas Triton backend" in warnings[0], warnings
        with pytest.raises(ValueError, match=r"'pallas' on compute capability .*no Pallas Triton backend"):
            resolve_impl("pallas", facts)
    with pytest.raises(ValueError, match=r"'interpret' runs the Triton kernels: .*no Pallas Triton backend"):
        resolve_impl("interpret", facts)


@pytest.mark.parametrize("decode_only", [False, True])
def test_without_triton_s_backend_a_pallas_step_off_hopper_runs_through_xla(decode_only, without_triton):
    """A step traced for `pallas` on a GPU other than Hopper never reaches the Triton kernels (which would
    need the backend) and still matches the oracle."""
    from jaxserve.ops import paged_attention_pallas

    rng = np.random.default_rng(3)
    case = make_case(rng, *MIXES["decodes" if decode_only else "mixed_with_empty"], 6, 2)
    got = np.asarray(run_jitted(ragged_paged_attention, *case.args, sm_scale=0.25, impl="pallas",
                                decode_only=decode_only, num_sms=108))
    assert_matches_oracle(got, case, 0.25)
    with pytest.raises(RuntimeError, match="no Pallas Triton backend"):
        paged_attention_pallas.ragged_paged_attention_pallas(*case.args, sm_scale=0.25, interpret=True)


BLOCK_TRITON = """
import importlib.abc, sys

class NoTriton(importlib.abc.MetaPathFinder):  # jax as it will be once the deprecated backend is gone
    def find_spec(self, name, path, target=None):
        if name == "jax.experimental.pallas.triton":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoTriton())
"""


def test_jaxserve_imports_and_serves_with_a_jax_that_dropped_triton_s_backend(tmp_path):
    """The Triton kernels' module imports where jax's `pallas.triton` is gone, so the whole package does: a
    CPU still serves, and a deviceless A100 compile still resolves attention (to XLA's path)."""
    script = tmp_path / "no_triton.py"
    script.write_text(BLOCK_TRITON + """
from jaxserve.device import target_facts
from jaxserve.ops import attention, paged_attention_pallas
import jaxserve.api.app, jaxserve.engine.llm_engine  # everything a server imports

assert paged_attention_pallas.TRITON_BACKEND is False
print(attention.resolve_impl("auto", target_facts("a100")), attention.resolve_impl("auto", target_facts("h100")))
""")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["reference", "pallas"]
    assert "no Pallas Triton backend" in result.stderr


def test_without_triton_s_backend_a_hopper_step_the_mosaic_kernel_does_not_take_says_so(without_triton, caplog):
    """An FP8 cache's steps stay off the Mosaic GPU kernel unless JAXSERVE_MOSAIC_FP8=1; without Triton's kernels
    they run through XLA, correct and slow, which one warning says."""
    import jax.numpy as jnp

    rng = np.random.default_rng(4)
    case = make_case(rng, *MIXES["mixed_with_empty"], 6, 2)
    fp8 = jnp.float8_e4m3fn
    k_pages, v_pages = (np.nan_to_num(np.asarray(pages)).astype(fp8) for pages in (case.k_pages, case.v_pages))
    case = dataclasses.replace(case, k_pages=k_pages, v_pages=v_pages)
    with caplog.at_level("WARNING", logger="jaxserve.ops.attention"):
        got = np.asarray(run_jitted(ragged_paged_attention, *case.args, sm_scale=0.25, impl="pallas", hopper=True,
                                    num_sms=132))
    exact = dataclasses.replace(case, k_pages=np.asarray(k_pages, np.float32), v_pages=np.asarray(v_pages, np.float32))
    assert_matches_oracle(got, exact, 0.25)
    assert [r.getMessage() for r in caplog.records if "Mosaic GPU kernel does not take" in r.getMessage()]
