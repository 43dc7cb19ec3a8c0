"""The KV cache's sizing on a GPU (runner/kv_sizing.py), with compiles stood in: an estimate (an earlier
start's record, the step's shapes, or quick compiles at a provisional page count), one real compile at the
final count, and a second sizing only where the real compile needs more temp memory than the margin left."""

import logging

import pytest

from jaxserve.runner.kv_budget import ALLOCATOR_SLACK_BYTES, KVBudget
from jaxserve.runner.kv_sizing import (
    QUICK_ESTIMATE_OPTIONS,
    TEMP_MARGIN_BYTES,
    shapes_estimate,
    size_kv_cache,
    with_margin,
)

MIB = 2**20
PAGE = MIB


class Compiled:
    def __init__(self, temp_bytes: int) -> None:
        self.temp_bytes = temp_bytes


def budget_for(temp_bytes: int) -> KVBudget:
    return KVBudget(device_memory_bytes=10_000 * MIB, utilization=0.9, weights_bytes=1_000 * MIB,
                    state_bytes=8 * MIB, peak_temp_bytes=temp_bytes, bytes_per_page=PAGE)


def compiler(quick_temp: int, real_temp: int, calls: list):
    """compile_largest: the largest mixed and decode buckets; the decode bucket needs a tenth of the temp."""
    def compile_largest(num_pages: int, options):
        calls.append((num_pages, options))
        temp = real_temp if options is None else quick_temp
        return {"mixed": Compiled(temp), "decode": Compiled(temp // 10)}
    return compile_largest


def test_one_quick_and_one_real_compile_where_the_margin_holds():
    calls = []
    sized = size_kv_cache(compiler(400 * MIB, 450 * MIB, calls), budget_for, provisional_pages=33, platform="gpu")
    kept = int(400 * MIB * 1.25) + TEMP_MARGIN_BYTES
    assert with_margin(400 * MIB) == kept
    assert calls == [(33, QUICK_ESTIMATE_OPTIONS["gpu"]), (sized.budget.num_pages, None)]
    assert QUICK_ESTIMATE_OPTIONS["gpu"] == {"xla_gpu_autotune_level": 0}  # what a GPU's compile is mostly
    assert sized.estimated_temp_bytes == 400 * MIB and not sized.resized
    assert sized.budget.peak_temp_bytes == kept
    free = 9_000 * MIB - 1_000 * MIB - 8 * MIB - kept - ALLOCATOR_SLACK_BYTES
    assert sized.budget.num_pages == free // PAGE
    assert sized.compiled["mixed"].temp_bytes == 450 * MIB  # the real executables, for the warm-up


def test_a_real_compile_over_the_margin_sizes_the_cache_again(caplog):
    calls = []
    with caplog.at_level(logging.WARNING, "jaxserve.runner.kv_sizing"):
        sized = size_kv_cache(compiler(400 * MIB, 700 * MIB, calls), budget_for, provisional_pages=33,
                              platform="gpu")
    first_count = budget_for(with_margin(400 * MIB)).num_pages
    assert calls == [(33, QUICK_ESTIMATE_OPTIONS["gpu"]), (first_count, None), (sized.budget.num_pages, None)]
    assert sized.resized and sized.budget.peak_temp_bytes == with_margin(700 * MIB)
    assert sized.budget.num_pages < first_count
    assert "700 MiB compiled" in caplog.text


def test_a_second_miss_raises_rather_than_risk_a_step_out_of_memory():
    temps = iter([400 * MIB, 700 * MIB, 2_000 * MIB])  # quick, real, real again after resizing

    def growing(num_pages: int, options):
        return {"mixed": Compiled(next(temps))}

    with pytest.raises(RuntimeError, match="after a second sizing; set --num-kv-pages"):
        size_kv_cache(growing, budget_for, provisional_pages=33, platform="gpu")


def test_a_platform_without_quick_options_estimates_with_a_real_compile():
    calls = []
    size_kv_cache(compiler(400 * MIB, 400 * MIB, calls), budget_for, provisional_pages=9, platform="tpu")
    assert [options for _, options in calls] == [None, None]


def test_no_room_after_the_estimate_raises_before_a_real_compile():
    calls = []

    def tiny(temp_bytes: int) -> KVBudget:
        return KVBudget(2_000 * MIB, 0.9, 1_000 * MIB, 0, temp_bytes, PAGE)

    with pytest.raises(ValueError, match="no room for a KV cache"):
        size_kv_cache(compiler(600 * MIB, 600 * MIB, calls), tiny, provisional_pages=9, platform="gpu")
    assert len(calls) == 1


def test_an_earlier_start_s_figure_replaces_the_quick_compiles():
    """A warm start given the figure the cold start sized for: no quick compile, and the cold start's page
    count, so the real compile is the cold start's executable (a persistent-cache hit)."""
    cold_calls, warm_calls = [], []
    cold = size_kv_cache(compiler(400 * MIB, 450 * MIB, cold_calls), budget_for, provisional_pages=33,
                         platform="gpu")
    warm = size_kv_cache(compiler(400 * MIB, 450 * MIB, warm_calls), budget_for, provisional_pages=33,
                         platform="gpu", known_temp_bytes=cold.sized_for_bytes)
    assert cold.sized_for_bytes == 400 * MIB and cold.real_temp_bytes == 450 * MIB and not cold.from_record
    assert warm_calls == [(cold.budget.num_pages, None)]  # the real compile alone, at the cold start's count
    assert warm.budget == cold.budget and warm.quick_seconds == 0 and warm.from_record and not warm.resized
    assert (warm.sized_for_bytes, warm.real_temp_bytes) == (cold.sized_for_bytes, cold.real_temp_bytes)


def test_an_earlier_figure_too_small_for_the_step_is_checked_and_replaced(caplog):
    """A record the step outgrew (a change the fingerprint missed) cannot overrun the device: the real
    compile's check sizes the cache again, and the real figure is what the next start gets."""
    calls = []
    with caplog.at_level(logging.WARNING, "jaxserve.runner.kv_sizing"):
        sized = size_kv_cache(compiler(400 * MIB, 700 * MIB, calls), budget_for, provisional_pages=33,
                              platform="gpu", known_temp_bytes=300 * MIB)
    first_count = budget_for(with_margin(300 * MIB)).num_pages
    assert calls == [(first_count, None), (sized.budget.num_pages, None)]  # no quick compile
    assert sized.resized and sized.sized_for_bytes == 700 * MIB and sized.real_temp_bytes == 700 * MIB
    assert sized.budget.peak_temp_bytes == with_margin(700 * MIB)
    assert "earlier start's figure (300 MiB)" in caplog.text
    # The next start, given that figure, compiles once at the resized count.
    again = []
    size_kv_cache(compiler(400 * MIB, 700 * MIB, again), budget_for, provisional_pages=33, platform="gpu",
                  known_temp_bytes=sized.sized_for_bytes)
    assert again == [(sized.budget.num_pages, None)]


def test_an_earlier_figure_that_leaves_no_room_is_estimated_again(caplog):
    """A record larger than the device now allows for (another GPU, a lower utilization) does not stop the
    start: the quick compiles run as on a cold start."""
    calls = []
    with caplog.at_level(logging.WARNING, "jaxserve.runner.kv_sizing"):
        sized = size_kv_cache(compiler(400 * MIB, 450 * MIB, calls), budget_for, provisional_pages=33,
                              platform="gpu", known_temp_bytes=20_000 * MIB)
    assert calls == [(33, QUICK_ESTIMATE_OPTIONS["gpu"]), (sized.budget.num_pages, None)]
    assert not sized.from_record and sized.sized_for_bytes == 400 * MIB
    assert "leaves no room for a KV cache: estimating it with quick compiles" in caplog.text


def test_a_cold_start_sizes_from_the_step_s_shapes_without_quick_compiles():
    """Given the estimate from the step's shapes, a cold start compiles once, for real, at the count that
    estimate and the margin leave; the record it leaves gives a warm start that count again."""
    calls = []
    cold = size_kv_cache(compiler(400 * MIB, 450 * MIB, calls), budget_for, provisional_pages=33, platform="gpu",
                         shapes_temp_bytes=500 * MIB)
    assert calls == [(budget_for(with_margin(500 * MIB)).num_pages, None)]
    assert cold.source == "shapes" and not cold.from_record and not cold.resized and cold.quick_seconds == 0
    assert (cold.sized_for_bytes, cold.real_temp_bytes) == (500 * MIB, 450 * MIB)
    warm_calls = []
    warm = size_kv_cache(compiler(400 * MIB, 450 * MIB, warm_calls), budget_for, provisional_pages=33,
                         platform="gpu", known_temp_bytes=cold.sized_for_bytes, shapes_temp_bytes=500 * MIB)
    assert warm_calls == calls and warm.budget == cold.budget and warm.source == "record"


def test_a_record_wins_over_the_shapes_and_a_short_estimate_is_checked(caplog):
    """An earlier start's figure is taken before the shapes' (it is what the persistent cache holds
    executables for); an estimate from the shapes under the real figure is caught by the real compile's
    check and the cache sized again, as a quick estimate would be."""
    calls = []
    size_kv_cache(compiler(400 * MIB, 450 * MIB, calls), budget_for, provisional_pages=33, platform="gpu",
                  known_temp_bytes=420 * MIB, shapes_temp_bytes=900 * MIB)
    assert calls == [(budget_for(with_margin(420 * MIB)).num_pages, None)]
    calls = []
    with caplog.at_level(logging.WARNING, "jaxserve.runner.kv_sizing"):
        sized = size_kv_cache(compiler(400 * MIB, 700 * MIB, calls), budget_for, provisional_pages=33,
                              platform="gpu", shapes_temp_bytes=300 * MIB)
    assert calls == [(budget_for(with_margin(300 * MIB)).num_pages, None), (sized.budget.num_pages, None)]
    assert sized.resized and sized.sized_for_bytes == 700 * MIB  # what the next start's record holds
    assert "estimate from its shapes (300 MiB)" in caplog.text


def test_the_shapes_estimate_counts_the_sampler_s_rows_and_the_widest_activation():
    """Float32 copies: 4.5 of the logits rows over the vocab, 2 of the widest activation over the token
    rows (GPT-2's largest `gpu` buckets: 256 requests, 2,048 tokens, its MLP's 3,072)."""
    assert shapes_estimate(256, 50257, 2048, 3072) == 4 * (4.5 * 256 * 50257 + 2 * 2048 * 3072)
    assert shapes_estimate(256, 50257, 2048, 3072) > shapes_estimate(256, 50257, 1024, 3072)


def test_the_step_s_estimate_takes_the_widest_weight_but_the_vocab_and_a_mixture_s_rows():
    """`temp_estimate`: the largest bucket's requests over the vocab; its tokens over the largest dimension
    of any weight but the vocab's (embeddings and heads are the vocab's); a mixture of experts' tokens
    times their top k, three times over (MOE_ROW_COPIES)."""
    from types import SimpleNamespace

    import numpy as np

    from jaxserve.models.moe import MoeConfig
    from jaxserve.runner.aot import temp_estimate
    from jaxserve.runner.buckets import Bucket
    from jaxserve.runner.kv_sizing import MOE_ROW_COPIES

    weights = [np.zeros((1000, 64)), np.zeros((64, 1000)), np.zeros((4, 64, 300)), np.zeros(64)]
    largest = [Bucket(512, 16), Bucket(32, 32, decode_only=True)]
    dense = SimpleNamespace(vocab_size=1000, moe=None)
    assert temp_estimate(dense, weights, largest) == shapes_estimate(32, 1000, 512, 300)
    mixture = SimpleNamespace(vocab_size=1000, moe=MoeConfig(num_experts=4, top_k=2, intermediate_size=300,
                                                             normalize_top_k=True))
    assert temp_estimate(mixture, weights, largest) == shapes_estimate(32, 1000, 512 * 2 * MOE_ROW_COPIES, 300)


def test_a_shapes_estimate_that_leaves_a_longest_request_too_few_pages_is_compiled_instead(caplog):
    """The shapes' figure is an upper estimate: on a device where its margin would leave fewer pages than a
    request of the longest length takes (the provisional count), the quick compiles give the figure."""
    calls = []
    tight = budget_for(0).num_pages  # every page the device has with no temp memory at all
    with caplog.at_level(logging.WARNING, "jaxserve.runner.kv_sizing"):
        sized = size_kv_cache(compiler(400 * MIB, 450 * MIB, calls), budget_for, provisional_pages=tight - 400,
                              platform="gpu", shapes_temp_bytes=1_000 * MIB)
    assert calls == [(tight - 400, QUICK_ESTIMATE_OPTIONS["gpu"]), (sized.budget.num_pages, None)]
    assert sized.source == "compiles" and sized.sized_for_bytes == 400 * MIB
    assert "a longest request takes" in caplog.text


def test_the_estimate_takes_one_device_s_share_of_a_sharded_weight():
    """With tensor parallelism the budget is one device's: a weight split over devices counts its shard's
    dimensions (an MLP's intermediate over 4 devices), and the vocab's weights none, split or not."""
    from types import SimpleNamespace

    from jaxserve.runner.aot import temp_estimate
    from jaxserve.runner.buckets import Bucket

    def sharded(shape, split_axis, ways):
        shard = tuple(d // ways if i == split_axis else d for i, d in enumerate(shape))
        return SimpleNamespace(shape=shape, ndim=len(shape), sharding=SimpleNamespace(shard_shape=lambda s: shard))

    cfg = SimpleNamespace(vocab_size=1000, moe=None)
    weights = [sharded((64, 1000), 1, 4), sharded((64, 800), 1, 4), sharded((800, 64), 0, 4)]
    assert temp_estimate(cfg, weights, [Bucket(512, 16)]) == shapes_estimate(16, 1000, 512, 200)
