"""Where a compiling thread's executables came from: compiled by XLA, loaded from JAX's persistent cache, or
compiled before in this process (`step_fn`'s shared programs, whose JAX caches hold the executable: nothing
reaches XLA). Told apart by JAX's monitoring events, which JAX sends in the thread that compiles, so threads
compiling side by side each count their own."""

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

COMPILED = "not cached"
LOADED = "from the persistent cache"
KEPT = "compiled before in this process"
_WORST_FIRST = (COMPILED, LOADED, KEPT)

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # an XLA compile, or a persistent-cache load
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_tally = threading.local()  # this thread's counts inside `counting()`


def _on_event(event: str, **_: Any) -> None:
    if event == _CACHE_HIT and hasattr(_tally, "loads"):
        _tally.loads += 1


def _on_duration(event: str, duration: float, **_: Any) -> None:
    if event == _BACKEND_COMPILE and hasattr(_tally, "compiles"):
        _tally.compiles += 1


@functools.cache  # registered once per process
def _listen() -> None:
    jax.monitoring.register_event_listener(_on_event)
    jax.monitoring.register_event_duration_secs_listener(_on_duration)


@contextlib.contextmanager
def counting() -> Iterator[Callable[[], str]]:
    """Counts this thread's compiles inside the block; yields a function that says, once the block is left,
    where their executables came from: COMPILED if XLA compiled any, LOADED if the persistent cache served
    every one, KEPT if none reached XLA. A block inside another adds its counts to the outer one's."""
    _listen()
    outer = (getattr(_tally, "compiles", None), getattr(_tally, "loads", None))
    _tally.compiles = _tally.loads = 0
    counted = [0, 0]  # compiles, loads: the block's, once it is left

    def origin() -> str:
        compiles, loads = counted
        if compiles == 0:
            return KEPT
        return LOADED if loads >= compiles else COMPILED

    try:
        yield origin
    finally:
        counted[:] = _tally.compiles, _tally.loads
        if outer[0] is None:
            del _tally.compiles, _tally.loads
        else:
            _tally.compiles, _tally.loads = outer[0] + counted[0], outer[1] + counted[1]


def worst(*origins: str) -> str:
    """The origin of executables made together (a step and its sampler): the costliest of theirs."""
    return min(origins, key=_WORST_FIRST.index)
