"""Python's cyclic garbage collector while a process traces and compiles its steps.

Why. Tracing and lowering a ladder of steps allocates millions of small objects, and most of them live on
(jaxprs, MLIR modules, the executables' Python wrappers). CPython collects its youngest generation after
every 700 net allocations, and as survivors pile up it keeps promoting them into full collections, each
one traversing every object the imports and the model made. At a server's start those collections held
the GIL for seconds, while the compile threads waited to trace their next bucket (docs/benchmarks.md).

How. `fewer_collections()` raises the youngest generation's threshold while a start traces, so the
collector runs far less often; the garbage it then finds is the same. The old thresholds return when the
last thread inside leaves (an engine's warm-up and a deviceless compile may overlap in one process).
A process that builds and drops engines (the offline `LLM`, the tests) still reclaims their cycles. A server,
which keeps its engine for good, freezes its start-up heap once it is ready (`freeze_start_up_heap`).

A server's large request (a body of 200,000 messages) is the other case. Its parse, validation and rendering
run on worker threads, but each full collection, and each free of a list of 200,000 items, is one call that
holds the interpreter lock, so the event loop waited for each: 60-75 ms a collection, ~100 ms the frees. Its
parse, validation and rendering run with `fewer_collections`, and its long lists are freed a slice at a time
(`empty_in_pieces`), off the event loop (docs/benchmarks.md, stop 100). The collector is not paused: what one
thread made while it was would be traversed by its next collection all at once, another request's or a compile's
objects with it.
"""

import contextlib
import gc
import threading
from collections.abc import Iterator

START_UP_THRESHOLD = 50_000  # net allocations between young collections; CPython's default is 700

_FREE_SLICE = 256  # items freed per call by `empty_in_pieces`

_lock = threading.Lock()
_inside = 0
_restore: tuple[int, ...] = ()


def freeze_start_up_heap() -> None:
    """A server's objects from its start (the imports, the model, the compiled steps: millions of them)
    moved out of the collector's reach for good, after one last collection (`gc.freeze`, as vLLM's server
    does once it is up). A full collection then traverses what the requests made since, not the whole
    start-up heap: the event loop no longer stops for the tenths of a second that each one took while a
    large request's objects piled up (docs/benchmarks.md, stop 97)."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Within it, the youngest generation is collected after `START_UP_THRESHOLD` net allocations (or
    the threshold set before, if higher)."""
    global _inside, _restore
    with _lock:
        if _inside == 0:
            _restore = gc.get_threshold()
            gc.set_threshold(max(START_UP_THRESHOLD, _restore[0]), *_restore[1:])
        _inside += 1
    try:
        yield
    finally:
        with _lock:
            _inside -= 1
            if _inside == 0:
                gc.set_threshold(*_restore)


def empty_in_pieces(*lists: list) -> None:
    """Empties each list `_FREE_SLICE` items at a time, so that what only it held is freed in calls short enough
    for other threads to run between them."""
    for items in lists:
        while items:
            del items[-_FREE_SLICE:]
