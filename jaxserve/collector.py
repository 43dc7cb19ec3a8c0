"""Python's cyclic garbage collector while a process traces and compiles its steps.

Why. Tracing and lowering a ladder of steps allocates millions of small objects, and most of them live on
(jaxprs, MLIR modules, the executables' Python wrappers). CPython collects its youngest generation after
every 700 net allocations, and as survivors pile up it keeps promoting them into full collections, each
one traversing every object the imports and the model made. At a server's start those collections held
the GIL for seconds, while the compile threads waited to trace their next bucket (docs/benchmarks.md).

How. `fewer_collections()` raises the youngest generation's threshold while a start traces, so the
collector runs far less often; the garbage it then finds is the same. The old thresholds return when the
last thread inside leaves (an engine's warm-up and a deviceless compile may overlap in one process).
Nothing is frozen or disabled: a process that builds and drops engines (the offline `LLM`, the tests)
still reclaims their cycles.
"""

import contextlib
import gc
import threading
from collections.abc import Iterator

START_UP_THRESHOLD = 50_000  # net allocations between young collections; CPython's default is 700

_lock = threading.Lock()
_inside = 0
_restore: tuple[int, ...] = ()


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
