"""Prometheus metrics, named `jaxserve:*` after vLLM's `vllm:*`, in a registry owned by the app.

Latencies are measured where the client sees them: from the moment the server accepted the request
(after parsing) to each output the engine hands back.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from jaxserve.engine.async_engine import EngineStats
from jaxserve.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                          0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class _EngineGauges(Collector):
    """Reads the engine's latest stats snapshot at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats | None], model_name: str) -> None:
        self._stats = stats
        self._model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self._stats() or EngineStats()
        for name, doc, value in (
            ("jaxserve:num_requests_running", "Sequences in the running batch.", stats.num_running),
            ("jaxserve:num_requests_waiting", "Sequences waiting for a slot or KV pages.", stats.num_waiting),
            ("jaxserve:kv_cache_usage_perc", "Fraction of KV pages in use (1 = full).", stats.kv_cache_usage),
        ):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self._model_name], value)
            yield family


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("jaxserve:prompt_tokens", "Prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter(
            "jaxserve:generation_tokens", "Generated tokens.", labels, registry=r
        )
        self.request_success = Counter(
            "jaxserve:request_success", "Finished requests by finish reason.", [*labels, "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "jaxserve:time_to_first_token_seconds", "Time to first token.", labels,
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "jaxserve:inter_token_latency_seconds", "Time between consecutive output tokens.", labels,
            buckets=_TOKEN_LATENCY_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "jaxserve:e2e_request_latency_seconds", "Request latency, arrival to last token.", labels,
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.registry.register(_EngineGauges(stats, model_name))
        self.stats = stats
        self.total_prompt_tokens = 0  # plain totals for the periodic log line
        self.total_generation_tokens = 0

    async def log_periodically(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        """vLLM-style throughput lines while there is traffic (cancelled on shutdown)."""
        last_prompt, last_generation = self.total_prompt_tokens, self.total_generation_tokens
        while True:
            await asyncio.sleep(interval_s)
            prompt, generation = self.total_prompt_tokens, self.total_generation_tokens
            stats = self.stats() or EngineStats()
            if prompt == last_prompt and generation == last_generation and not stats.num_running:
                continue
            logger.info(
                "prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, running: %d, "
                "waiting: %d, KV cache usage: %.1f%%",
                (prompt - last_prompt) / interval_s, (generation - last_generation) / interval_s,
                stats.num_running, stats.num_waiting, 100 * stats.kv_cache_usage,
            )
            last_prompt, last_generation = prompt, generation

    async def track(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """Passes a request's outputs through, recording its latencies and token counts."""
        name = self.model_name
        arrival = last = time.perf_counter()
        num_tokens = 0
        finished = False
        try:
            async for output in outputs:
                now = time.perf_counter()
                self._observe(output, now - arrival, now - last, num_tokens)
                if output.num_generated_tokens > num_tokens:
                    num_tokens, last = output.num_generated_tokens, now
                finished = output.finished
                yield output
        finally:
            if not finished:  # the client left or the engine failed: counted as aborted
                self.request_success.labels(name, "abort").inc()

    def _observe(self, output: RequestOutput, since_arrival: float, since_last: float, num_tokens: int) -> None:
        name = self.model_name
        new_tokens = output.num_generated_tokens - num_tokens
        if new_tokens > 0:
            if num_tokens == 0:
                self.ttft.labels(name).observe(since_arrival)
                self.prompt_tokens.labels(name).inc(output.num_prompt_tokens)
                self.total_prompt_tokens += output.num_prompt_tokens
            else:
                self.itl.labels(name).observe(since_last / new_tokens)
            self.generation_tokens.labels(name).inc(new_tokens)
            self.total_generation_tokens += new_tokens
        if output.finished:
            self.e2e.labels(name).observe(since_arrival)
            for completion in output.outputs:
                self.request_success.labels(name, completion.finish_reason or "abort").inc()
