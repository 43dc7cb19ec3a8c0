"""How long jax spent in Python on the way to XLA in this thread inside a block: tracing to jaxprs and
lowering them to StableHLO. That part of a compile holds the GIL, so compiles on threads side by side do it
one at a time while XLA's part runs in parallel: on a many-core host it is what a ladder's warm-up waits for
once XLA's compiles are spread over the cores, and all that a warm start's compiles cost beyond the
persistent cache's loads.

Read from JAX's monitoring events, which JAX sends in the thread that traces or lowers, where each ends; each
is a wall-clock span, so a thread's figure would include the time it waited for the GIL while another thread
traced: the compiles measured here trace one at a time (`aot.compile_bucket`, the warm-up's lock). Spans
inside another are counted once (jax 0.10-0.12 send no event for a jit traced inside another; this holds if
one does)."""

import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax

_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_local = threading.local()  # .tally: this thread's innermost open block's `_Tally`


@dataclass
class TraceTime:
    """Seconds spent tracing and lowering; a block's, once it is left."""

    trace_seconds: float = 0.0
    lower_seconds: float = 0.0

    def __add__(self, other: "TraceTime") -> "TraceTime":
        return TraceTime(self.trace_seconds + other.trace_seconds, self.lower_seconds + other.lower_seconds)


@dataclass
class _Tally:
    traces: list[tuple[float, float]]  # (start, end) of each trace that ended in the block
    lower_seconds: float = 0.0


def _on_duration(event: str, duration: float, **_: Any) -> None:
    tally = getattr(_local, "tally", None)
    if tally is None:
        return
    if event == _TRACE:
        end = time.perf_counter()
        tally.traces.append((end - duration, end))
    elif event == _LOWER:
        tally.lower_seconds += duration


@functools.cache  # registered once per process
def _listen() -> None:
    jax.monitoring.register_event_duration_secs_listener(_on_duration)


def _outermost_seconds(spans: list[tuple[float, float]]) -> float:
    """The summed length of the spans not inside another (one thread's: traces nest, never overlap)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans, key=lambda span: (span[0], -span[1])):
        if end > reach:  # not inside the last outer span
            total += end - start
            reach = end
    return total


@contextlib.contextmanager
def measuring() -> Iterator[TraceTime]:
    """Yields a TraceTime that holds, once the block is left, what this thread traced and lowered inside it.
    A block inside another adds its counts to the outer one's."""
    _listen()
    outer = getattr(_local, "tally", None)
    tally, result = _Tally([]), TraceTime()
    _local.tally = tally
    try:
        yield result
    finally:
        _local.tally = outer
        if outer is not None:
            outer.traces += tally.traces
            outer.lower_seconds += tally.lower_seconds
        result.trace_seconds = _outermost_seconds(tally.traces)
        result.lower_seconds = tally.lower_seconds
