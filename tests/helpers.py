"""Helpers shared across test areas."""

from collections.abc import Iterator
from contextlib import contextmanager

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
