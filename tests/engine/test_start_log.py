"""What an engine's start says in the log, as benchmarks/startup.py reads it: the GPU check's start-up
figures come from these lines."""

import logging
import time

import jax

from jaxserve import IMPORTED_AT
from jaxserve.engine import core
from tests.helpers import startup_phases


def test_the_backend_line_says_which_backend_and_when_it_started(caplog):
    with caplog.at_level(logging.INFO, "jaxserve.engine.core"):
        core._start_backend()
    match = startup_phases()["backend_s"].search(caplog.text)
    assert match is not None
    assert 0 < float(match.group(1)) <= time.monotonic() - IMPORTED_AT + 0.1
    assert f"backend: {jax.default_backend()}, {len(jax.devices())} x {jax.devices()[0].device_kind}" in caplog.text
