"""Sliding-window attention, logit soft-capping and attention sinks in every attention implementation,
against the float64 oracle: windows inside a page, across pages and longer than the context; GQA groups;
prefill chunks after cached tokens, decodes and mixes. Pages wholly before every query's window hold NaN,
so an implementation that reads them fails (the server may free those pages)."""

import jax
import numpy as np
import pytest

from jaxserve.ops import cpu_kernels
from jaxserve.ops.attention import ragged_paged_attention
from jaxserve.ops.paged_attention_pallas import paged_decode_attention_pallas
from tests.helpers import pairwise, run_jitted
from tests.ops.paged_cases import MIXES, blank_before_windows, make_case, oracle

NATIVE = cpu_kernels.kernel_error() is None
native = pytest.param("cpu-native", marks=pytest.mark.skipif(not NATIVE, reason="native kernels unavailable"))
WINDOWS = [1, 3, 4, 9, 64]  # one key; inside a page of 4; a page; across pages; beyond every context
SOFTCAP = 1.5  # scores of about +-3 here (sm_scale 0.7): the cap bends them


def check(got, case, sm_scale: float, window: int | None, softcap: float | None, tol: float = 2e-5,
          sinks: np.ndarray | None = None) -> None:
    got = np.asarray(got, np.float32)
    real = case.num_real_tokens
    assert np.all(np.isfinite(got)), "a page before every window was read"
    want = oracle(case, sm_scale, sliding_window=window, logit_softcap=softcap, sinks=sinks)
    np.testing.assert_allclose(got[:real], want[:real], atol=tol, rtol=tol)
    assert np.all(got[real:] == 0), "padding tokens must come back as zeros"


def windowed_case(mix: str, window: int | None, num_q_heads: int, num_kv_heads: int, **kwargs):
    case = make_case(np.random.default_rng(len(mix) + (window or 0)), *MIXES[mix], num_q_heads, num_kv_heads,
                     **kwargs)
    return case if window is None else blank_before_windows(case, window)


@pytest.mark.cpu_only("the attention paths for CPUs")
@pytest.mark.parametrize(("window", "mix", "impl"), pairwise(WINDOWS, sorted(MIXES), ["reference", "cpu", native]))
def test_cpu_paths_attend_within_the_window(window, mix, impl):
    case = windowed_case(mix, window, 6, 2)
    got = run_jitted(ragged_paged_attention, *case.args, sm_scale=0.7, sliding_window=window, impl=impl)
    check(got, case, 0.7, window, None)


@pytest.mark.cpu_only("the attention paths for CPUs")
@pytest.mark.parametrize("impl", ["reference", "cpu", native])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("mix", ["long", "mixed_with_empty"])
def test_cpu_paths_soft_cap_the_scores(impl, window, mix):
    case = windowed_case(mix, window, 4, 2)
    got = run_jitted(ragged_paged_attention, *case.args, sm_scale=0.7, sliding_window=window, logit_softcap=SOFTCAP,
                     impl=impl)
    check(got, case, 0.7, window, SOFTCAP)
    plain = oracle(case, 0.7, sliding_window=window)[: case.num_real_tokens]
    assert np.abs(np.asarray(got)[: case.num_real_tokens] - plain).max() > 1e-2, "the cap changed nothing"


@pytest.mark.cpu_only("the native CPU kernel")
@pytest.mark.skipif(not NATIVE, reason="native kernels unavailable here")
@pytest.mark.parametrize("head_dim", [16, 64])  # 64: the blocked loops of many-row units
@pytest.mark.parametrize("page_size,window", [(4, 7), (16, 30), (128, 100), (128, 3)])  # 128: runs of 64 keys
def test_native_kernel_windows_over_many_row_units(head_dim, page_size, window):
    """Units of 64 rows (chunks of 70 tokens under GQA 3) whose rows' windows start in different runs."""
    rng = np.random.default_rng(head_dim + page_size + window)
    q_lens, kv_lens = [1, 70, 23, 1, 0], [200, 75, 23, 3, 0]
    case = make_case(rng, q_lens, kv_lens, 9, 3, page_size=page_size, head_dim=head_dim, pad_tokens=3,
                     pad_reqs=1, max_pages=-(-200 // page_size) + 1)
    case = blank_before_windows(case, window)
    got = cpu_kernels.ragged_paged_attention(*case.args, sm_scale=0.3, sliding_window=window, logit_softcap=SOFTCAP)
    check(got, case, 0.3, window, SOFTCAP)


@pytest.mark.slow  # Pallas' interpreter
@pytest.mark.gpu
@pytest.mark.parametrize("window,softcap", [(3, None), (20, SOFTCAP), (None, SOFTCAP)])
@pytest.mark.parametrize("mix", ["long", "mixed_with_empty", "chunk_after_cache"])
def test_ragged_kernel_windows_and_caps(window, softcap, mix):
    from tests.ops.test_paged_attention_pallas import KERNEL_IMPL, TOLERANCE

    case = windowed_case(mix, window, 8, 2, page_size=4, head_dim=64)
    got = run_jitted(ragged_paged_attention, *case.args, sm_scale=0.2, sliding_window=window, logit_softcap=softcap,
                     impl=KERNEL_IMPL)
    check(got, case, 0.2, window, softcap, tol=TOLERANCE[np.float32])


@pytest.mark.slow  # Pallas' interpreter
@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window,softcap", [(5, None), (40, SOFTCAP)])
def test_decode_kernel_windows_and_caps(num_splits, window, softcap):
    """Split-KV decodes over the blocks inside each request's window only."""
    from tests.ops.test_paged_attention_pallas import INTERPRET, TOLERANCE

    kv_lens = [1, 16, 17, 33, 150]
    case = make_case(np.random.default_rng(window), [1] * 5, kv_lens, 8, 2, page_size=16, head_dim=64,
                     pad_tokens=0, pad_reqs=0, max_pages=10)
    case = blank_before_windows(case, window)
    q, k_pages, v_pages, lens, table, _ = case.args
    got = run_jitted(paged_decode_attention_pallas, q, k_pages, v_pages, lens, table, sm_scale=0.2,
                     sliding_window=window, logit_softcap=softcap, interpret=INTERPRET, num_splits=num_splits,
                     block_kv=32)
    check(got, case, 0.2, window, softcap, tol=TOLERANCE[np.float32])


def head_sinks(num_q_heads: int) -> np.ndarray:
    """Sink logits from far below the scores (no effect) to far above (most of the weight) by head."""
    return np.linspace(-6.0, 4.0, num_q_heads).astype(np.float32)


def assert_sinks_matter(got, case, sm_scale: float, window: int | None) -> None:
    plain = oracle(case, sm_scale, sliding_window=window)[: case.num_real_tokens]
    assert np.abs(np.asarray(got)[: case.num_real_tokens] - plain).max() > 1e-2, "the sinks changed nothing"


@pytest.mark.cpu_only("the attention paths for CPUs")
@pytest.mark.parametrize("impl", ["reference", "cpu", native])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("mix", ["long", "mixed_with_empty", "chunk_after_cache"])
def test_cpu_paths_take_attention_sinks(impl, window, mix):
    """GPT-OSS's sinks: each query head's logit joins its softmax's denominator (windowed layers too), and
    padding tokens and requests that see nothing still come back as zeros."""
    case = windowed_case(mix, window, 6, 2)
    sinks = head_sinks(6)
    got = jax.jit(lambda s, *a: ragged_paged_attention(*a, sm_scale=0.7, sliding_window=window, sinks=s,
                                                       impl=impl))(sinks, *case.args)
    check(got, case, 0.7, window, None, sinks=sinks)
    assert_sinks_matter(got, case, 0.7, window)


@pytest.mark.slow  # Pallas' interpreter
@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("mix", ["long", "mixed_with_empty"])
def test_ragged_kernel_takes_attention_sinks(window, mix):
    """Each row of a program's query block starts its softmax from its own head's sink (GQA groups of 4)."""
    from tests.ops.test_paged_attention_pallas import KERNEL_IMPL, TOLERANCE

    case = windowed_case(mix, window, 8, 2, page_size=4, head_dim=64)
    sinks = head_sinks(8)
    got = run_jitted(ragged_paged_attention, *case.args, sm_scale=0.2, sliding_window=window, sinks=sinks,
                     impl=KERNEL_IMPL)
    check(got, case, 0.2, window, None, tol=TOLERANCE[np.float32], sinks=sinks)
    assert_sinks_matter(got, case, 0.2, window)


@pytest.mark.slow  # Pallas' interpreter
@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_takes_attention_sinks(num_splits):
    """The sinks join the splits' partial softmaxes once, where they are merged; a padding request (no keys)
    stays zero."""
    from tests.ops.test_paged_attention_pallas import INTERPRET, TOLERANCE

    kv_lens = [1, 16, 17, 33, 150, 0]
    case = make_case(np.random.default_rng(11), [1] * 5 + [0], kv_lens, 8, 2, page_size=16, head_dim=64,
                     pad_tokens=1, pad_reqs=0, max_pages=10)
    q, k_pages, v_pages, lens, table, _ = case.args
    sinks = head_sinks(8)
    got = run_jitted(paged_decode_attention_pallas, q, k_pages, v_pages, lens, table, sm_scale=0.2, sinks=sinks,
                     interpret=INTERPRET, num_splits=num_splits, block_kv=32)
    check(got, case, 0.2, None, None, tol=TOLERANCE[np.float32], sinks=sinks)
    assert_sinks_matter(got, case, 0.2, None)


# (query heads, KV heads, head dim, window, soft cap) of Gemma 2 2B's and Gemma 3 1B's local layers.
GEMMA_LOCAL_LAYERS = {"gemma-2-2b": (8, 4, 256, 4096, 50.0), "gemma-3-1b": (4, 1, 256, 512, None)}


@pytest.mark.parametrize("model", sorted(GEMMA_LOCAL_LAYERS))
def test_windowed_kernels_lower_for_cuda(model):
    """Both Pallas kernels with a window and a cap lower to Triton for an H100 (deviceless on a CPU)."""
    import jax.numpy as jnp

    from jaxserve.ops.paged_attention_pallas import ragged_paged_attention_pallas
    from tests.ops.test_paged_attention_pallas import calls_triton, lower_for_cuda

    num_q_heads, num_kv_heads, head_dim, window, cap = GEMMA_LOCAL_LAYERS[model]
    pages = ((num_kv_heads, 2048, 16, head_dim), jnp.bfloat16)
    scores = dict(sm_scale=head_dim**-0.5, sliding_window=window, logit_softcap=cap)
    ragged = lower_for_cuda(lambda *a: ragged_paged_attention_pallas(*a, **scores),
                            ((512, num_q_heads, head_dim), jnp.bfloat16), pages, pages, ((64,), jnp.int32),
                            ((64, 512), jnp.int32), ((65,), jnp.int32))
    decode = lower_for_cuda(lambda *a: paged_decode_attention_pallas(*a, **scores),
                            ((64, num_q_heads, head_dim), jnp.bfloat16), pages, pages, ((64,), jnp.int32),
                            ((64, 512), jnp.int32))
    assert calls_triton(ragged) and calls_triton(decode)


def test_kernels_with_sinks_lower_for_cuda():
    """Both Pallas kernels with GPT-OSS-20B's sliding layers' shapes (64 query heads over 8 KV heads of 64,
    a window of 128) and sinks lower to Triton for an H100 (deviceless on a CPU)."""
    import jax.numpy as jnp

    from jaxserve.ops.paged_attention_pallas import ragged_paged_attention_pallas
    from tests.ops.test_paged_attention_pallas import calls_triton, lower_for_cuda

    pages = ((8, 2048, 16, 64), jnp.bfloat16)
    sinks = ((64,), jnp.float32)
    scores = dict(sm_scale=64**-0.5, sliding_window=128)
    ragged = lower_for_cuda(lambda s, *a: ragged_paged_attention_pallas(*a, sinks=s, **scores), sinks,
                            ((512, 64, 64), jnp.bfloat16), pages, pages, ((64,), jnp.int32),
                            ((64, 512), jnp.int32), ((65,), jnp.int32))
    decode = lower_for_cuda(lambda s, *a: paged_decode_attention_pallas(*a, sinks=s, **scores), sinks,
                            ((64, 64, 64), jnp.bfloat16), pages, pages, ((64,), jnp.int32), ((64, 512), jnp.int32))
    assert calls_triton(ragged) and calls_triton(decode)
