"""Prometheus metrics: the module with fake RequestOutputs (milliseconds, no model), then once through a
real app in-process."""

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from jaxserve.api.app import create_app
from jaxserve.api.metrics import ServerMetrics, build_1_2_5_buckets
from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import AsyncEngine, EngineStats
from jaxserve.engine.scheduler import ITERATION_TOKENS_BUCKETS
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tests.api.helpers import wait_for
from tests.engine.helpers import make_engine

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(text: str) -> Samples:
    """Every sample of an exposition, keyed by (name, sorted labels)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted({"model_name": "m", **labels}.items()))), 0.0)


def choice(index: int, num_tokens: int, reason: str | None) -> CompletionOutput:
    """A completion's delta: `num_tokens` new tokens."""
    return CompletionOutput(index=index, token_ids=list(range(num_tokens)), finish_reason=reason)


def stream(*outputs: RequestOutput) -> AsyncIterator[RequestOutput]:
    async def gen() -> AsyncIterator[RequestOutput]:
        for output in outputs:
            yield output

    return gen()


def run(metrics: ServerMetrics, outputs: AsyncIterator[RequestOutput], take: int | None = None) -> Samples:
    """Drives `track` like a handler (leaving after `take` outputs if given) and scrapes."""

    async def consume() -> None:
        tracked = metrics.track(outputs)
        count = 0
        async for _ in tracked:
            count += 1
            if count == take:
                break
        await tracked.aclose()

    asyncio.run(consume())
    return scrape(generate_latest(metrics.registry).decode())


STAMPS = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0,
                        last_token_time=103.0, max_tokens_param=16)


def test_a_request_with_n_3_counts_once_with_its_stages():
    metrics = ServerMetrics("m", lambda: None, max_model_len=64)
    prompt = [1, 2, 3, 4]
    # DELTA outputs (the API's kind): choices end with 5, 3 and 2 tokens.
    first = RequestOutput("r", None, prompt, [choice(0, 1, None), choice(1, 1, None), choice(2, 0, None)])
    last = RequestOutput("r", None, prompt, [choice(0, 4, "length"), choice(1, 2, "stop"), choice(2, 2, "stop")],
                         finished=True, metrics=STAMPS)
    samples = run(metrics, stream(first, last))
    assert value(samples, "jaxserve:request_success_total", finished_reason="length") == 1
    assert value(samples, "jaxserve:request_success_total", finished_reason="stop") == 0, "the first choice's"
    assert value(samples, "jaxserve:request_params_n_count") == 1
    assert value(samples, "jaxserve:request_params_n_sum") == 3
    assert value(samples, "jaxserve:request_params_n_bucket", le="2.0") == 0
    assert value(samples, "jaxserve:request_params_n_bucket", le="5.0") == 1
    assert value(samples, "jaxserve:request_prompt_tokens_sum") == 4
    assert value(samples, "jaxserve:request_generation_tokens_sum") == 10, "all choices, as usage counts them"
    assert value(samples, "jaxserve:generation_tokens_total") == 10
    assert value(samples, "jaxserve:request_max_num_generation_tokens_sum") == 5
    assert value(samples, "jaxserve:request_params_max_tokens_sum") == 16
    assert value(samples, "jaxserve:request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert value(samples, "jaxserve:request_prefill_time_seconds_sum") == pytest.approx(0.5)
    assert value(samples, "jaxserve:request_decode_time_seconds_sum") == pytest.approx(2.0)
    assert value(samples, "jaxserve:request_inference_time_seconds_sum") == pytest.approx(2.5)
    assert value(samples, "jaxserve:time_per_output_token_seconds_sum") == pytest.approx(2.0 / 4), "longest choice"
    assert value(samples, "jaxserve:e2e_request_latency_seconds_count") == 1
    assert value(samples, "jaxserve:time_to_first_token_seconds_count") == 1
    assert not [name for name, _ in samples if name.endswith("_created")]
    assert ("jaxserve:request_prompt_tokens_bucket", (("le", "128.0"), ("model_name", "m"))) not in samples, (
        "token buckets stop at max_model_len")


def test_a_one_token_request_has_no_time_per_output_token():
    metrics = ServerMetrics("m", lambda: None)
    samples = run(metrics, stream(RequestOutput("r", None, [1], [choice(0, 1, "stop")], True, STAMPS)))
    assert value(samples, "jaxserve:request_decode_time_seconds_count") == 1
    assert value(samples, "jaxserve:time_per_output_token_seconds_count") == 0


def test_a_request_left_early_counts_as_aborted_without_request_histograms():
    metrics = ServerMetrics("m", lambda: None)
    partial = RequestOutput("r", None, [1, 2], [choice(0, 1, None)])
    samples = run(metrics, stream(partial, partial), take=1)
    assert value(samples, "jaxserve:request_success_total", finished_reason="abort") == 1
    assert value(samples, "jaxserve:request_generation_tokens_count") == 0
    assert value(samples, "jaxserve:e2e_request_latency_seconds_count") == 0


def test_engine_snapshot_gauges_preemptions_iteration_tokens_and_cache_info():
    counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    counts[0], counts[1], counts[-1] = 2, 3, 1  # two 1-token steps, three of 2..8 tokens, one over 16384
    stats = EngineStats(num_running=2, num_waiting=1, kv_cache_usage=0.25, num_preemptions=4,
                        iteration_tokens_buckets=tuple(counts), iteration_tokens_sum=20000)
    metrics = ServerMetrics("m", lambda: stats, cache_info={"block_size": "16", "num_gpu_blocks": "100"})
    samples = scrape(generate_latest(metrics.registry).decode())
    assert value(samples, "jaxserve:num_requests_running") == 2
    assert value(samples, "jaxserve:num_requests_waiting") == 1
    assert value(samples, "jaxserve:kv_cache_usage_perc") == 0.25
    assert value(samples, "jaxserve:num_preemptions_total") == 4
    assert value(samples, "jaxserve:iteration_tokens_total_bucket", le="1.0") == 2
    assert value(samples, "jaxserve:iteration_tokens_total_bucket", le="8.0") == 5, "cumulative"
    assert value(samples, "jaxserve:iteration_tokens_total_bucket", le="16384.0") == 5
    assert value(samples, "jaxserve:iteration_tokens_total_bucket", le="+Inf") == 6
    assert value(samples, "jaxserve:iteration_tokens_total_count") == 6
    assert value(samples, "jaxserve:iteration_tokens_total_sum") == 20000
    assert samples[("jaxserve:cache_config_info", (("block_size", "16"), ("num_gpu_blocks", "100")))] == 1


def test_speculative_decoding_counts_are_vllm_s_spec_decode_series():
    stats = EngineStats(spec_decode_num_drafts=5, spec_decode_num_draft_tokens=14, spec_decode_num_accepted_tokens=9,
                        spec_decode_accepted_per_position=(5, 3, 1))
    for prefix in ("jaxserve", "vllm"):
        samples = scrape(generate_latest(ServerMetrics("m", lambda: stats, prefix=prefix).registry).decode())
        assert value(samples, f"{prefix}:spec_decode_num_drafts_total") == 5
        assert value(samples, f"{prefix}:spec_decode_num_draft_tokens_total") == 14
        assert value(samples, f"{prefix}:spec_decode_num_accepted_tokens_total") == 9
        for position, count in enumerate((5, 3, 1)):
            assert value(samples, f"{prefix}:spec_decode_num_accepted_tokens_per_pos_total",
                         position=str(position)) == count


def test_data_parallel_ranks_are_series_labelled_engine_as_vllm_labels_them():
    from jaxserve.engine.data_parallel import combined_stats

    counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    counts[0] = 3
    ranks = [EngineStats(num_running=2, kv_cache_usage=0.5, prefix_cache_hits=7, iteration_tokens_buckets=tuple(counts),
                         iteration_tokens_sum=3, spec_decode_accepted_per_position=(4, 1)),
             EngineStats(num_waiting=3, prefix_cache_hits=1, spec_decode_accepted_per_position=(2, 0))]
    stats = combined_stats(ranks, [100, 100])
    samples = scrape(generate_latest(ServerMetrics("m", lambda: stats).registry).decode())
    assert [value(samples, "jaxserve:num_requests_running", engine=e) for e in "01"] == [2, 0]
    assert [value(samples, "jaxserve:num_requests_waiting", engine=e) for e in "01"] == [0, 3]
    assert [value(samples, "jaxserve:kv_cache_usage_perc", engine=e) for e in "01"] == [0.5, 0.0]
    assert [value(samples, "jaxserve:prefix_cache_hits_total", engine=e) for e in "01"] == [7, 1]
    assert [value(samples, "jaxserve:iteration_tokens_total_count", engine=e) for e in "01"] == [3, 0]
    assert value(samples, "jaxserve:spec_decode_num_accepted_tokens_per_pos_total", engine="1", position="0") == 2
    # No series without the label: a sum over `engine` is the whole engine, nothing counted twice.
    assert not any(name.startswith("jaxserve:num_requests") and "engine" not in dict(labels)
                   for name, labels in samples)


def test_no_engine_yet_reads_as_zeros_and_created_series_stay_elsewhere():
    metrics = ServerMetrics("m", lambda: None)
    samples = scrape(generate_latest(metrics.registry).decode())
    assert value(samples, "jaxserve:num_requests_running") == 0
    assert value(samples, "jaxserve:iteration_tokens_total_count") == 0
    assert not any(name == "jaxserve:cache_config_info" for name, _ in samples), "only when the server says"
    assert not any(name.startswith("jaxserve:spec_decode") for name, _ in samples), "only with drafting on"
    other = CollectorRegistry()
    Counter("other", "Another registry in the same process.", registry=other).inc()
    assert "other_created" in generate_latest(other).decode(), "no process-wide switch was flipped"


def test_1_2_5_buckets():
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(256)[-1] == 200


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    with TestClient(create_app(ServerConfig(), AsyncEngine(make_engine(tiny_model_dir("llama"), warmup=False)))) as c:
        yield c


def test_metrics_through_the_app_after_a_completions_request_with_n_3(client):
    before = scrape(client.get("/metrics").text)
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    after = scrape(client.get("/metrics").text)

    def delta(name: str, **labels: str) -> float:
        name_labels = (name, tuple(sorted({"model_name": after_model, **labels}.items())))
        return after.get(name_labels, 0.0) - before.get(name_labels, 0.0)

    after_model = next(dict(labels)["model_name"] for name, labels in after if name == "jaxserve:num_requests_running")
    assert sum(delta("jaxserve:request_success_total", finished_reason=r) for r in ("stop", "length", "abort")) == 1
    assert delta("jaxserve:request_params_n_count") == 1 and delta("jaxserve:request_params_n_sum") == 3
    assert delta("jaxserve:request_params_max_tokens_sum") == 6
    assert delta("jaxserve:request_prompt_tokens_sum") == usage["prompt_tokens"] == 5
    assert delta("jaxserve:request_generation_tokens_sum") == usage["completion_tokens"]
    assert delta("jaxserve:generation_tokens_total") == usage["completion_tokens"]
    assert not [name for name, _ in after if name.endswith("_created")]
    stages = {stage: delta(f"jaxserve:request_{stage}_time_seconds_sum")
              for stage in ("queue", "prefill", "decode", "inference")}
    assert all(delta(f"jaxserve:request_{stage}_time_seconds_count") == 1 for stage in stages)
    assert all(seconds >= 0 for seconds in stages.values()), stages
    assert stages["inference"] == pytest.approx(stages["prefill"] + stages["decode"], abs=1e-6)
    assert delta("jaxserve:iteration_tokens_total_count") >= 1
    assert delta("jaxserve:iteration_tokens_total_sum") >= 5, "at least the prompt was computed"


    def idle() -> bool:  # the engine publishes its snapshot just after it hands out the last output
        now = scrape(client.get("/metrics").text)
        gauges = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        return all(value(now, f"jaxserve:{gauge}", model_name=after_model) == 0 for gauge in gauges)

    wait_for(idle)


def histogram_quantile(samples: Samples, name: str, q: float) -> float:
    """PromQL's histogram_quantile over one scrape's cumulative buckets (linear within the bucket)."""
    buckets = sorted((float(dict(labels)["le"]), count) for (n, labels), count in samples.items()
                     if n == f"{name}_bucket")
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            return lower + (upper - lower) * (rank - below) / (count - below) if count > below else upper
        lower, below = upper, count
    return buckets[-1][0]


def test_the_vllm_prefix_serves_every_series_under_vllm_names_and_its_dashboard_queries_answer():
    """`--metrics-prefix vllm`: the same series, each named `vllm:*` (none `jaxserve:*`), so the queries of
    vLLM's published Grafana dashboard read them: the running and waiting gauges, KV usage, token counters,
    and the latency quantiles from the histograms."""
    stats = EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.25)
    ours, theirs = (ServerMetrics("m", lambda: stats, max_model_len=64, prefix=p) for p in ("jaxserve", "vllm"))
    prompt = [1, 2, 3, 4]

    def outputs() -> AsyncIterator[RequestOutput]:
        return stream(RequestOutput("r", None, prompt, [choice(0, 1, None)]),
                      RequestOutput("r", None, prompt, [choice(0, 4, "length")], finished=True, metrics=STAMPS))

    want, got = run(ours, outputs()), run(theirs, outputs())
    assert got and all(name.startswith("vllm:") for name, _ in got)
    renamed = {(name.replace("jaxserve:", "vllm:", 1), labels) for name, labels in want}
    assert set(got) == renamed, "the same series under the other prefix"
    for gauge, expected in (("vllm:num_requests_running", 3), ("vllm:num_requests_waiting", 2),
                            ("vllm:kv_cache_usage_perc", 0.25)):  # sum(vllm:...{model_name="$model_name"})
        assert value(got, gauge) == expected
    assert value(got, "vllm:prompt_tokens_total") == 4 and value(got, "vllm:generation_tokens_total") == 5
    assert value(got, "vllm:request_success_total", finished_reason="length") == 1
    # histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket[...]))): one request,
    # whose end to end latency (this test's wall clock: its bucket varies with the machine's load) lands in one
    # of the same buckets under either name
    def edges(samples, name: str) -> list[str]:
        return sorted(dict(labels)["le"] for sample, labels in samples if sample == f"{name}_bucket")

    assert histogram_quantile(got, "vllm:e2e_request_latency_seconds", 0.99) > 0
    assert edges(got, "vllm:e2e_request_latency_seconds") == edges(want, "jaxserve:e2e_request_latency_seconds")
    assert len(edges(got, "vllm:e2e_request_latency_seconds")) > 10
    with pytest.raises(ValueError, match="metrics_prefix must be one of jaxserve, vllm"):
        ServerConfig(metrics_prefix="sglang")
    from jaxserve.cli import _server_config, build_parser

    assert _server_config(build_parser().parse_args(["serve", "--metrics-prefix", "vllm"])).metrics_prefix == "vllm"
    assert _server_config(build_parser().parse_args(["serve"])).metrics_prefix == "jaxserve"
