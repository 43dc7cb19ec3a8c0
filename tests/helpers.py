"""Helpers shared across test areas."""

import importlib.util
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jax


@contextmanager
def count_compilations() -> Iterator[list[str]]:
    """Counts XLA backend compilations inside the block."""
    events: list[str] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def startup_phases() -> dict[str, re.Pattern]:
    """benchmarks/startup.py's patterns for the server's log, by phase: the GPU check's start-up figures
    are read from the lines they match."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "startup.py"
    spec = importlib.util.spec_from_file_location("startup_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._PHASES
