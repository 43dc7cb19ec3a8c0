"""The suite's XLA compiles, test by test: with JAXSERVE_TEST_COMPILE_LOG set to a file, each test process
(every xdist worker) appends a JSON line per compile and per persistent-cache hit, naming the test that ran
it (a module fixture's compiles count to the first test that asked for it). `python
benchmarks/suite_compiles.py FILE` sums them by file and by program, and lists any program compiled twice,
which a shared cache should never do. Servers and engine cores the tests start in processes of their own are
not counted.

It reads what JAX's compiler module logs at DEBUG (a cache miss names its key; the write after the compile
gives its seconds), so a JAX that words those lines otherwise leaves the file without compiles: a tool for
looking at the suite's time, not a test."""

import json
import logging
import os
import re
import threading
import time

import pytest

_MISS = re.compile(r"PERSISTENT COMPILATION CACHE MISS for '(.+)' with key '(.+)'")
_HIT = re.compile(r"Persistent compilation cache hit for '(.+)' with key '(.+)'")
_COMPILED = re.compile(r"'(.+)' took at least .* \(([\d.]+)s\)"  # written to the cache
                       r"|Not writing persistent cache entry for '(.+)' .*\(([\d.]+)s\)")  # too quick to


class CompileLog(logging.Handler):
    """A pytest plugin and the logging handler it puts on `jax._src.compiler`."""

    def __init__(self, path: str) -> None:
        super().__init__(logging.DEBUG)
        self.path = path
        self.test = "(collection)"
        self._keys: dict[tuple[int, str], str] = {}  # (thread, program) -> the key its miss named
        self._lock = threading.Lock()
        compiler = logging.getLogger("jax._src.compiler")
        compiler.addHandler(self)
        compiler.setLevel(logging.DEBUG)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if miss := _MISS.search(message):
            self._keys[record.thread, miss[1]] = miss[2]
        elif hit := _HIT.search(message):
            self._write({"kind": "hit", "program": hit[1], "key": hit[2]})
        elif compiled := _COMPILED.search(message):
            program, seconds = (compiled[1], compiled[2]) if compiled[1] else (compiled[3], compiled[4])
            key = self._keys.pop((record.thread, program), None)
            self._write({"kind": "compile", "program": program, "key": key, "seconds": float(seconds)})

    def _write(self, record: dict) -> None:
        record.update(test=self.test, worker=os.environ.get("PYTEST_XDIST_WORKER", "main"), time=time.time())
        with self._lock, open(self.path, "a") as log:
            log.write(json.dumps(record) + "\n")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        self.test = item.nodeid

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        self.test = item.nodeid

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        self.test = f"{item.nodeid} (teardown)"
