"""Helpers shared across test areas."""

import functools
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jax
import pytest

# What a test engine that sizes its KV cache by budget (a test server, the bundled model's engine) may take of
# a GPU: under the tenth of it that each test process's pool may grow to (tests/conftest.py). A budget equal to
# the pool left its warm-up's temp buffers no room on an H200 (docs/benchmarks.md, stop 66), and six workers'
# engines and servers must fit the device together. A CPU's budget is --kv-cache-memory instead.
TEST_GPU_MEMORY_UTILIZATION = 0.06


def run_jitted(fn, *args, **options):
    """fn(*args, **options) as one jitted program, as a step runs it: op by op, each of its operations would
    compile on its own (a test of an attention path compiled ten to thirty programs where it needs one)."""
    return jax.jit(functools.partial(fn, **options))(*args)


def approx_floats(answer):
    """A JSON answer with every float compared to float32's precision, the rest exactly: for answers computed in
    steps that may batch differently (which requests share a step depends on when they arrive)."""
    if isinstance(answer, dict):
        return {key: approx_floats(value) for key, value in answer.items()}
    if isinstance(answer, list):
        return [approx_floats(value) for value in answer]
    return pytest.approx(answer, rel=1e-5, abs=1e-6) if isinstance(answer, float) else answer


def pairwise(first: list, second: list, third: list) -> list:
    """Cases that hold every pair of values from two of the three lists, where the full grid holds every
    triple: each (x, y) of first x second once, third's values in turn along the diagonals, so that each
    (x, z) and (y, z) pair appears too. A value may be a pytest.param with marks (a skip); its case takes them."""
    assert len(first) >= len(third) and len(second) >= len(third), "third's values would miss some pairs"
    param_set = type(pytest.param(None))
    cases = []
    for i, x in enumerate(first):
        for j, y in enumerate(second):
            values = (x, y, third[(i + j) % len(third)])
            marks = [mark for v in values if isinstance(v, param_set) for mark in v.marks]
            cases.append(pytest.param(*(v.values[0] if isinstance(v, param_set) else v for v in values), marks=marks))
    return cases


@contextmanager
def count_compilations() -> Iterator[list[str]]:
    """Counts XLA compilations inside the block: backend compiles, and executables loaded from the persistent
    cache in their place (a step that another test compiled first is a load here, and still a compile that
    warm-up should have done)."""
    events: list[str] = []

    def compiled(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    def loaded(event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(compiled)
    jax.monitoring.register_event_listener(loaded)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(compiled)
        jax.monitoring.unregister_event_listener(loaded)


def startup_phases() -> dict[str, re.Pattern]:
    """benchmarks/startup.py's patterns for the server's log, by phase: the GPU check's start-up figures
    are read from the lines they match."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "startup.py"
    spec = importlib.util.spec_from_file_location("startup_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._PHASES


def skip_a_build_like_the_suite_s(flags: str) -> None:
    """Skips a test of the native kernels built with `flags` (`-mno-avx512f`, `-mno-avx`) where this CPU lacks
    what they take away: `-march=native` then makes the same code, which the rest of the suite has tested
    (an AVX2 machine's suite runs the AVX2 loops). The build would still be a library of its own, as the
    flags are in its cache key, and take a compile of every kernel to prove nothing more."""
    from jaxserve.device import cpu_flags

    removed = {"-mno-avx512f": "avx512f", "-mno-avx": "avx"}[flags]
    if removed not in cpu_flags():
        pytest.skip(f"this CPU has no {removed}: built with {flags}, the kernels are the suite's own build")


def run_with_kernel_flags(script: str, flags: str) -> subprocess.CompletedProcess:
    """`script` (Python source, dedented here) in a process of its own, from the repository root, with the
    native CPU kernels built with `flags` appended (`JAXSERVE_KERNEL_FLAGS`): a process loads the kernels'
    library once, so another build needs another process. The build goes to the kernel cache the suite's
    own builds use: its key holds the flags, so each set of flags is built once for every test (and run)
    that asks for it. The process inherits this one's backend; the tests that call this are `cpu_only`, so
    that backend is the CPU."""
    env = {**os.environ, "JAXSERVE_KERNEL_FLAGS": flags}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).resolve().parents[1])
