"""Ending a process at once, without waiting for threads that cannot be stopped.

A background warm-up's XLA compiles run on pool threads that Python joins at interpreter exit, and XLA
cannot interrupt a compile: a server told to stop after its requests drained would otherwise stay up
until every compile under way had finished (half a minute on a GPU with a dozen at once). The process's
own work is done by then (requests drained, the engine stopped), so it flushes its output and exits.
"""

import contextlib
import logging
import os
import sys


def exit_now(code: int) -> None:
    """Flushes logging and the standard streams, then ends the process with `code`, skipping exit
    handlers and the join of non-daemon threads."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or gone: nothing left to write there
            stream.flush()
    os._exit(code)
