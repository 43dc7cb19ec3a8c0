"""Ending a process at once, without waiting for threads that cannot be stopped.

A background warm-up's XLA compiles run on pool threads that Python joins at interpreter exit, and XLA
cannot interrupt a compile: a server told to stop after its requests drained would otherwise stay up
until every compile under way had finished (half a minute on a GPU with a dozen at once). The process's
own work is done by then (requests drained, the engine stopped), so it flushes its output and exits.

Two things still finish first: a write to JAX's persistent compilation cache under way (JAX writes each
entry in place, and a truncated one would be neither read nor rewritten by later starts: `guard_cache_writes`
makes every write hold a lock that the exit takes), and, in a multi-host job, JAX's distributed shutdown
(process 0 hosts the coordination service, whose other processes wait for it at their own exit).
"""

import contextlib
import logging
import os
import sys
import threading

_cache_writes = threading.Lock()  # held while JAX writes a persistent-cache entry
CACHE_WRITE_WAIT_S = 30.0  # one entry's write: milliseconds to a second; a stuck disk does not keep us


def guard_cache_writes() -> None:
    """Makes JAX's persistent-cache writes hold `_cache_writes` (idempotent)."""
    from jax._src import compilation_cache  # jax 0.10-0.12 write every entry through this function

    put = compilation_cache.put_executable_and_time
    if getattr(put, "jaxserve_guarded", False):
        return

    def guarded(*args, **kwargs):
        with _cache_writes:
            return put(*args, **kwargs)

    guarded.jaxserve_guarded = True
    compilation_cache.put_executable_and_time = guarded


def exit_now(code: int) -> None:
    """Waits for a persistent-cache write under way and a multi-host job's distributed shutdown, flushes
    logging and the standard streams, then ends the process with `code`, skipping exit handlers and the
    join of non-daemon threads."""
    _cache_writes.acquire(timeout=CACHE_WRITE_WAIT_S)  # kept: no write starts after this
    if "jax" in sys.modules:
        import jax

        if jax.distributed.is_initialized():
            jax.distributed.shutdown()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or gone: nothing left to write there
            stream.flush()
    os._exit(code)
