"""`jaxserve bench serve`'s client against the real server: its sampling fields reach the server."""

import asyncio

import pytest

from jaxserve.bench.serve import run_level
from tests.api.helpers import API_KEY


def test_bench_serve_sends_its_sampling_fields(server):
    sampled = {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "min_p": 0.05}
    result = asyncio.run(run_level(server.v1, None, 2, 4, 8, 6, api_key=API_KEY, sampling=sampled))
    assert result["failed"] == 0 and result["completed"] == 4, result["errors"]
    assert result["output_tokens_per_s"] * result["duration_s"] == pytest.approx(4 * 6)
    # A value the server refuses proves each field is sent.
    for field, bad in [("top_p", 1.5), ("top_k", -5), ("min_p", 2.0), ("temperature", -1.0)]:
        sampling = {**sampled, field: bad}
        refused = asyncio.run(run_level(server.v1, None, 1, 1, 8, 2, api_key=API_KEY, sampling=sampling))
        assert refused["failed"] == 1 and "HTTP 400" in refused["errors"][0] and field in refused["errors"][0]
