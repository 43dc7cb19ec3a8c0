"""Sizing the KV cache on a GPU with one round of the compiles a start makes anyway (no jax).

The KV cache gets what the step's peak temp memory leaves (`kv_budget.py`), and only a compile of the step
tells its temp memory; but the page count is one of the step's argument shapes, so a compile at a
provisional count is not the step that serves, and the warm-up compiled the largest bucket a second time.
Autotuning picks GEMM tilings and does not change what the step keeps in temp memory beyond a workspace; so
the sizing goes:

1. estimate: from the step's shapes (`shapes_estimate`), or where the caller has none, the largest mixed
   and decode buckets compiled at a provisional page count with the backend's quick options (autotuning
   off on a GPU), for their temp memory;
2. size: the page count from that estimate plus `TEMP_MARGIN` (what autotuning may add: split-K and cuBLAS
   workspaces);
3. compile those buckets for real at that page count: the warm-up's first executables, kept;
4. check: their real temp memory within the margin; where it is not, the count is sized again from it (with
   the margin again) and they compile again, checked again (logged: the margin is then too small for that
   model); a second miss raises rather than risk running out of memory in a step.

On an H200 the quick compiles took about as long as the real ones, most of a cold start
(docs/benchmarks.md): a step's compile is mostly its kernels' code generation, not autotuning. The estimate
from the shapes costs nothing, and step 4 checks it as it checks a quick one: a figure too small costs the
second round of real compiles that the quick compiles cost before, one too large only KV pages.

A warm start that has the temp memory an earlier start sized for (`temp_records.py`) skips step 1: its
budget keeps that figure with the margin, which gives the earlier start's page count where the device's
memory and --gpu-memory-utilization are the earlier start's too, so step 3 loads the earlier start's
executables from the persistent cache; step 4 checks them as before. A recorded figure that leaves no room
for the cache is not trusted, and the quick compiles estimate after all; so they do where the shapes'
figure, an upper estimate, would leave fewer pages than a request of the longest length takes.

`jaxserve compile` sizes its report's cache with steps 1 and 2 from the shapes, as a cold start does.
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from jaxserve.runner.kv_budget import KVBudget

logger = logging.getLogger(__name__)

# Compile options that give a step's temp memory in a fraction of a real compile's time, by platform
# (jax.Device.platform). Platforms without an entry estimate with a real compile.
QUICK_ESTIMATE_OPTIONS: dict[str, dict[str, Any]] = {"gpu": {"xla_gpu_autotune_level": 0}}

# The estimate from the step's shapes: float32 copies of the largest step's logits rows (the sampler's: its
# sort, top-k and top-p, the log-softmax) and of its widest activation over the tokens' rows (the MLP's);
# above every bundled shape's compiled figure for an H100 before the margin (docs/benchmarks.md, and
# tests/test_compile_ladder.py checks it).
SAMPLER_COPIES = 4.5
ACTIVATION_COPIES = 2
# A mixture of experts' token rows: each token's top-k copies, held about three times over (the rows
# dispatched to the experts, their outputs, the combination; fitted to Qwen3-30B-A3B's compile).
MOE_ROW_COPIES = 3


def shapes_estimate(logit_rows: int, vocab_size: int, token_rows: int, widest_activation: int) -> int:
    """The step's temp memory from its shapes: `logit_rows` (the largest bucket's requests) over the vocab,
    and `token_rows` (its tokens, times the experts each token visits in a mixture of experts) over the
    widest activation (the largest dimension of any weight that is not the vocab's), float32 copies."""
    return int(4 * (SAMPLER_COPIES * logit_rows * vocab_size + ACTIVATION_COPIES * token_rows * widest_activation))


# Left over the estimate for what the real compile's autotuned kernels may add.
TEMP_MARGIN_FRACTION = 0.25
TEMP_MARGIN_BYTES = 64 * 2**20


def with_margin(estimated_temp_bytes: int) -> int:
    """The temp memory a budget keeps for a step whose temp memory was estimated at `estimated_temp_bytes`."""
    return int(estimated_temp_bytes * (1 + TEMP_MARGIN_FRACTION)) + TEMP_MARGIN_BYTES


class HasTempBytes(Protocol):
    """What the sizing reads of a compiled bucket (`aot.CompiledBucket`)."""

    temp_bytes: int


C = TypeVar("C", bound=HasTempBytes)
# (page count, compile options; None: the real compile) -> the largest buckets compiled, by bucket.
CompileLargest = Callable[[int, dict[str, Any] | None], dict[Any, C]]


@dataclass(frozen=True)
class SizedKVCache(Generic[C]):
    """The sizing's result: the budget, and the largest buckets compiled at its page count."""

    budget: KVBudget  # its peak_temp_bytes: what the page count was sized for
    estimated_temp_bytes: int  # the quick compile's, the shapes', or the earlier start's figure (`source`)
    sized_for_bytes: int  # what the budget kept the margin over: the estimate, or the real figure where resized
    real_temp_bytes: int  # the real compile's, at budget.num_pages
    compiled: dict[Any, C]  # the largest buckets compiled for real at budget.num_pages (compile_largest's)
    resized: bool  # the real compile needed more temp memory than the margin left: sized a second time
    from_record: bool  # the earlier start's figure was the estimate
    quick_seconds: float  # the quick compiles' wall time (0 from a record or the shapes)
    real_seconds: float  # the real compiles' (both rounds where resized)
    source: str = "compiles"  # of the estimate: record (an earlier start's), shapes, or compiles (quick ones)


def quick_budget(
    compile_largest: CompileLargest,
    budget_for: Callable[[int], KVBudget],
    provisional_pages: int,
    platform: str,
) -> tuple[KVBudget, int]:
    """Steps 1 and 2: (the budget that keeps the quick estimate with the margin, the estimate).
    `budget_for(temp_bytes)`: the budget that keeps `temp_bytes` for the step. Raises (`KVBudget.check`)
    where not even two pages fit."""
    estimated = _peak_temp(compile_largest(provisional_pages, QUICK_ESTIMATE_OPTIONS.get(platform)))
    budget = budget_for(with_margin(estimated))
    budget.check()
    return budget, estimated


def size_kv_cache(
    compile_largest: CompileLargest,
    budget_for: Callable[[int], KVBudget],
    provisional_pages: int,
    platform: str,
    known_temp_bytes: int | None = None,
    shapes_temp_bytes: int | None = None,
    any_size: bool = False,
) -> SizedKVCache:
    """Sizes the cache as the module docstring says (`quick_budget`'s arguments; `provisional_pages`: the
    pages of a request of the longest length, plus one); `known_temp_bytes`: the figure an earlier start
    sized for, which replaces the quick compiles where it leaves room for a cache; else `shapes_temp_bytes`
    (`shapes_estimate`) does, where it leaves a longest request's pages (`any_size`: any cache, whose size
    the longest request's then follows: --max-model-len auto)."""
    start = time.perf_counter()
    source = "record" if known_temp_bytes is not None else "shapes" if shapes_temp_bytes is not None else "compiles"
    if source != "compiles":
        estimated = known_temp_bytes if known_temp_bytes is not None else shapes_temp_bytes
        budget, quick_seconds = budget_for(with_margin(estimated)), 0.0
        # The shapes' figure is an upper estimate: where its margin would cost a request of the longest
        # length its pages (a tight device), the quick compiles' figure is worth their time
        fewest = 2 if source == "record" or any_size else provisional_pages
        if budget.num_pages < fewest:
            logger.warning("the step's temp memory %s (%.0f MiB) leaves %s: estimating it with quick compiles",
                           "recorded by an earlier start" if source == "record" else "estimated from its shapes",
                           estimated / 2**20, "no room for a KV cache" if source == "record" else
                           f"{budget.num_pages} KV pages (a longest request takes {provisional_pages - 1})")
            source = "compiles"
    from_record = source == "record"
    if source == "compiles":
        budget, estimated = quick_budget(compile_largest, budget_for, provisional_pages, platform)
        quick_seconds = time.perf_counter() - start
    compiled = compile_largest(budget.num_pages, None)
    real = sized_for = _peak_temp(compiled)
    resized = real > budget.peak_temp_bytes
    if resized:
        logger.warning("the step's temp memory is %.0f MiB compiled, over the %.0f MiB kept from its %s "
                       "(%.0f MiB): sizing the KV cache again", real / 2**20, budget.peak_temp_bytes / 2**20,
                       _SOURCES[source], estimated / 2**20)
        budget = budget_for(with_margin(real))
        budget.check()
        compiled = compile_largest(budget.num_pages, None)
        if (real := _peak_temp(compiled)) > budget.peak_temp_bytes:
            raise RuntimeError(f"the step's temp memory is {real / 2**20:.0f} MiB compiled at {budget.num_pages} "
                               f"KV pages, over the {budget.peak_temp_bytes / 2**20:.0f} MiB its budget keeps "
                               "after a second sizing; set --num-kv-pages")
    else:
        sized_for = estimated
    return SizedKVCache(budget, estimated, sized_for, real, compiled, resized, from_record, quick_seconds,
                        time.perf_counter() - start - quick_seconds, source)


_SOURCES = {"record": "earlier start's figure", "shapes": "estimate from its shapes", "compiles": "quick estimate"}


def _peak_temp(compiled: dict[Any, C]) -> int:
    return max(c.temp_bytes for c in compiled.values())
