"""One piece of work on a daemon thread, its result or exception in a future: the start-up's overlaps (weights
loading while the steps compile, a CPU's KV cache zeroed while the first one traces)."""

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


def on_a_thread(work: Callable[[], Any], name: str) -> Future:
    """`work()` on a daemon thread (an exit never waits for it), its result or exception in the future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as error:  # the waiter raises it
            future.set_exception(error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
