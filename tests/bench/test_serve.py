"""`jaxserve bench serve`'s client against the real server: its sampling fields reach the server, and
requests arrive at the request rate."""

import asyncio
import math

import numpy as np
import pytest

from jaxserve.bench.serve import arrival_offsets, run_level
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


def test_requests_arrive_as_a_poisson_process_of_the_request_rate():
    """vLLM's --request-rate: exponential gaps of mean 1/rate from a seed, the first request at once; an
    infinite rate sends every request at once."""
    offsets = arrival_offsets(4000, 50.0, seed=3)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and (gaps > 0).all() and offsets == arrival_offsets(4000, 50.0, seed=3)
    assert np.mean(gaps) == pytest.approx(1 / 50, rel=0.05) and np.std(gaps) == pytest.approx(1 / 50, rel=0.08)
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]


def test_bench_serve_sends_at_the_request_rate(server):
    offsets = arrival_offsets(4, 10.0, seed=0)
    result = asyncio.run(run_level(server.v1, None, 4, 4, 8, 2, api_key=API_KEY, seed=0, request_rate=10.0))
    assert result["failed"] == 0 and result["completed"] == 4 and result["request_rate"] == 10.0
    assert result["duration_s"] >= offsets[-1], "the last request was not sent before its arrival time"
    with pytest.raises(ValueError, match="request_rate must be > 0"):
        asyncio.run(run_level(server.v1, None, 1, 1, 8, 2, api_key=API_KEY, request_rate=0.0))
