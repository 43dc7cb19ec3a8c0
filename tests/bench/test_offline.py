"""`jaxserve bench offline`'s peak memory counts the engine's core processes, where the weights live."""

import multiprocessing

from jaxserve.bench.offline import peak_rss_gib


def _hold(size: int, ready, done) -> None:
    block = bytearray(size)  # zero pages are not resident until written
    block[::4096] = b"x" * len(block[::4096])
    ready.set()
    done.wait(60)


def test_peak_rss_adds_the_engine_core_processes():
    context = multiprocessing.get_context("spawn")
    ready, done = context.Event(), context.Event()
    size = 256 * 2**20
    child = context.Process(target=_hold, args=(size, ready, done), name="jaxserve-core-test", daemon=True)
    before = peak_rss_gib()
    child.start()
    try:
        assert ready.wait(60)
        assert peak_rss_gib() - before >= size / 2**30
    finally:
        done.set()
        child.join(10)
    other = context.Process(target=_hold, args=(size, ready, done), name="not-a-core", daemon=True)
    ready.clear()
    done.clear()
    other.start()
    try:
        assert ready.wait(60)
        assert peak_rss_gib() - before < size / 2**30  # only the engine's cores count
    finally:
        done.set()
        other.join(10)
