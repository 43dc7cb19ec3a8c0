"""Prometheus metrics, named `jaxserve:*` after vLLM's `vllm:*` and meaning what vLLM's mean, in a
registry owned by the app.

Where each number comes from:
- Latencies the client sees (time to first token, inter-token latency, end to end) are measured here,
  from the moment the server accepted the request (after parsing) to each output the engine hands back.
- Stage times (queue, prefill, decode, inference) and the mean time per output token come from the
  engine's own timestamps, carried on the finished RequestOutput (`RequestOutput.metrics`): only the
  engine thread knows when a request was first scheduled.
- Scheduler state (running, waiting, KV usage, preemptions, tokens per step) is read at scrape time from
  the engine's latest `EngineStats`, which the engine thread replaces whole after each iteration; a
  scrape takes no lock and never sees a half-written state, and the engine loop does no prometheus work.

A request here is one engine request (a completions call with several prompts makes several). With
n > 1 it counts once: `request_success_total` goes up by 1, labelled with the first choice's finish
reason (vLLM labels a request with its parent's; the first choice is our stand-in, and with n = 1 it is
exact); the token histograms see the prompt once and the choices' tokens summed, as `usage` reports.

No `_created` series are exported (vLLM serves none): the registry drops them itself, rather than through
prometheus_client's process-wide `disable_created_metrics()`, so importing this module changes nothing
for other registries in the process.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from jaxserve.engine.async_engine import EngineStats
from jaxserve.engine.scheduler import ITERATION_TOKENS_BUCKETS
from jaxserve.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                          0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's for request_params_n
_DEFAULT_MAX_MODEL_LEN = 131072  # token-count buckets reach this when the server does not say


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value`: vLLM's buckets for per-request token counts."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class _NoCreatedRegistry(CollectorRegistry):
    """A registry that leaves out prometheus_client's `*_created` samples and serves every `jaxserve:*` name
    under `prefix` (vLLM's `vllm:` names the same series)."""

    def __init__(self, prefix: str = "jaxserve") -> None:
        super().__init__()
        self._rename = prefix != "jaxserve"
        self._prefix = f"{prefix}:"

    def _renamed(self, name: str) -> str:
        return self._prefix + name.removeprefix("jaxserve:") if self._rename else name

    def collect(self) -> Iterator[Metric]:
        for metric in super().collect():
            # Counter and Histogram build a fresh Metric per scrape, so changing it in place is safe.
            metric.samples = [s._replace(name=self._renamed(s.name)) for s in metric.samples
                              if not s.name.endswith("_created")]
            metric.name = self._renamed(metric.name)
            yield metric


class _EngineCollector(Collector):
    """Reads the engine's latest stats snapshot at scrape time."""

    def __init__(
        self, stats: Callable[[], EngineStats | None], model_name: str, cache_info: Mapping[str, str] | None
    ) -> None:
        self._stats = stats
        self._model_name = model_name
        self._cache_info = dict(cache_info) if cache_info else None

    def collect(self) -> Iterator[Metric]:
        stats = self._stats() or EngineStats()
        # One series per engine core: the engine's, or with data parallelism each rank's, labelled `engine`
        # as vLLM labels its engines (a sum over the label is the whole engine).
        names = ["model_name", "engine"] if len(stats.ranks) > 1 else ["model_name"]
        series = ([([self._model_name, str(rank)], snapshot) for rank, snapshot in enumerate(stats.ranks)]
                  if len(stats.ranks) > 1 else [([self._model_name], stats)])
        for family, name, doc, field in (
            (GaugeMetricFamily, "jaxserve:num_requests_running", "Sequences in the running batch.", "num_running"),
            (GaugeMetricFamily, "jaxserve:num_requests_waiting", "Sequences waiting for a slot or KV pages.",
             "num_waiting"),
            (GaugeMetricFamily, "jaxserve:kv_cache_usage_perc", "Fraction of KV pages in use (1 = full).",
             "kv_cache_usage"),
            (CounterMetricFamily, "jaxserve:num_preemptions", "Cumulative number of preemptions from the engine.",
             "num_preemptions"),
            (CounterMetricFamily, "jaxserve:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.", "prefix_cache_queries"),
            (CounterMetricFamily, "jaxserve:prefix_cache_hits",
             "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits"),
        ):
            metric = family(name, doc, labels=names)
            for labels, snapshot in series:
                metric.add_metric(labels, getattr(snapshot, field))
            yield metric
        if stats.spec_decode_accepted_per_position:  # speculative decoding is on (vLLM's series then)
            yield from self._speculation(names, series)
        yield self._iteration_tokens(names, series)
        if stats.max_loras:  # --enable-lora: vLLM's info series, its value the scrape's time
            lora = GaugeMetricFamily("jaxserve:lora_requests_info", "Running stats on LoRA requests.",
                                     labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            lora.add_metric([str(stats.max_loras), ",".join(stats.waiting_lora_adapters),
                             ",".join(stats.running_lora_adapters)], time.time())
            yield lora
        if self._cache_info is not None:
            info = GaugeMetricFamily(
                "jaxserve:cache_config_info", "Information of the engine's cache config.",
                labels=list(self._cache_info),
            )
            info.add_metric(list(self._cache_info.values()), 1)
            yield info

    @staticmethod
    def _speculation(names: list[str], series: list[tuple[list[str], EngineStats]]) -> Iterator[Metric]:
        for name, doc, field in (
            ("jaxserve:spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_decode_num_drafts"),
            ("jaxserve:spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_decode_num_draft_tokens"),
            ("jaxserve:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
             "spec_decode_num_accepted_tokens"),
        ):
            counter = CounterMetricFamily(name, doc, labels=names)
            for labels, snapshot in series:
                counter.add_metric(labels, getattr(snapshot, field))
            yield counter
        per_position = CounterMetricFamily("jaxserve:spec_decode_num_accepted_tokens_per_pos",
                                           "Accepted tokens per draft position.", labels=[*names, "position"])
        for labels, snapshot in series:
            for position, count in enumerate(snapshot.spec_decode_accepted_per_position):
                per_position.add_metric([*labels, str(position)], count)
        yield per_position

    @staticmethod
    def _iteration_tokens(names: list[str], series: list[tuple[list[str], EngineStats]]) -> HistogramMetricFamily:
        histogram = HistogramMetricFamily(
            "jaxserve:iteration_tokens_total", "Histogram of number of tokens per engine step.", labels=names,
        )
        # floatToGoString writes bounds as prometheus_client's own Histogram does ("8.0", "+Inf").
        bounds = [floatToGoString(b) for b in (*ITERATION_TOKENS_BUCKETS, float("inf"))]
        for labels, snapshot in series:
            counts = snapshot.iteration_tokens_buckets or (0,) * (len(ITERATION_TOKENS_BUCKETS) + 1)
            cumulative, buckets = 0, []
            for bound, count in zip(bounds, counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            histogram.add_metric(labels, buckets, snapshot.iteration_tokens_sum)
        return histogram


class ServerMetrics:
    """The app's metrics: `track` wraps each engine request's outputs; `registry` is what /metrics serves.

    `max_model_len` bounds the per-request token-count buckets (vLLM's 1-2-5 ladder). `cache_info` is
    the label set of `jaxserve:cache_config_info` (a gauge fixed at 1, vLLM's way of exporting config),
    under vLLM's CacheConfig names where one exists (`block_size`, `num_gpu_blocks` whatever the device,
    since dashboards written for vLLM read those); the series is left out when None.
    """

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats | None],
        max_model_len: int | None = None,
        cache_info: Mapping[str, str] | None = None,
        prefix: str = "jaxserve",
    ) -> None:
        self.registry: CollectorRegistry = _NoCreatedRegistry(prefix)
        self.model_name = model_name
        self.stats = stats
        labels = ["model_name"]
        r = self.registry

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=tuple(buckets), registry=r)

        token_buckets = build_1_2_5_buckets(max_model_len or _DEFAULT_MAX_MODEL_LEN)
        self.prompt_tokens = Counter("jaxserve:prompt_tokens", "Prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("jaxserve:generation_tokens", "Generated tokens.", labels, registry=r)
        self.request_success = Counter(
            "jaxserve:request_success", "Finished requests by finish reason (with n > 1: the first choice's).",
            [*labels, "finished_reason"], registry=r,
        )
        self.request_prompt_tokens = histogram(
            "jaxserve:request_prompt_tokens", "Number of prefill tokens processed, per request.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "jaxserve:request_generation_tokens", "Number of generation tokens processed, per request (all choices).",
            token_buckets,
        )
        self.request_max_num_generation_tokens = histogram(
            "jaxserve:request_max_num_generation_tokens",
            "Histogram of maximum number of generated tokens over a request's choices.", token_buckets,
        )
        self.request_params_n = histogram("jaxserve:request_params_n", "Histogram of the n request parameter.",
                                          _N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "jaxserve:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
        self.ttft = histogram("jaxserve:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram(
            "jaxserve:inter_token_latency_seconds", "Time between consecutive output tokens.", _TOKEN_LATENCY_BUCKETS
        )
        self.tpot = histogram(
            "jaxserve:time_per_output_token_seconds",
            "Mean time per output token of a request, after its first (decode time / (tokens - 1)).",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "jaxserve:e2e_request_latency_seconds", "Request latency, arrival to last token.", _LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "jaxserve:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
            _LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "jaxserve:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
            _LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "jaxserve:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
            _LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "jaxserve:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
            _LATENCY_BUCKETS,
        )
        self.registry.register(_EngineCollector(stats, model_name, cache_info))
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
        """Passes a request's outputs through, recording its latencies and token counts. The outputs are
        DELTA ones (`RequestOutputKind`, the API's kind): each holds the tokens its step added."""
        arrival = last = time.perf_counter()
        choice_tokens: dict[int, int] = {}  # tokens so far, per completion index
        finished = False
        try:
            async for output in outputs:
                now = time.perf_counter()
                num_tokens = sum(choice_tokens.values())
                for completion in output.outputs:
                    choice_tokens[completion.index] = choice_tokens.get(completion.index, 0) + len(completion.token_ids)
                self._observe(output, now - arrival, now - last, num_tokens, choice_tokens)
                if output.num_generated_tokens:
                    last = now
                finished = output.finished
                yield output
        finally:
            if not finished:  # the client left or the engine failed: counted as aborted
                self.request_success.labels(self.model_name, "abort").inc()

    def _observe(self, output: RequestOutput, since_arrival: float, since_last: float, num_tokens: int,
                 choice_tokens: dict[int, int]) -> None:
        """`num_tokens`: the request's tokens before this output; `choice_tokens`: per completion, after it."""
        name = self.model_name
        new_tokens = output.num_generated_tokens
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
            self._observe_finished(output, choice_tokens)

    def _observe_finished(self, output: RequestOutput, choice_tokens: dict[int, int]) -> None:
        """The per-request metrics vLLM records when a request finishes."""
        name = self.model_name
        reason = output.outputs[0].finish_reason if output.outputs else None
        self.request_success.labels(name, reason or "abort").inc()
        max_choice_tokens = max(choice_tokens.values(), default=0)
        self.request_prompt_tokens.labels(name).observe(output.num_prompt_tokens)
        self.request_generation_tokens.labels(name).observe(sum(choice_tokens.values()))
        self.request_max_num_generation_tokens.labels(name).observe(max_choice_tokens)
        self.request_params_n.labels(name).observe(len(output.outputs))
        metrics = output.metrics
        if metrics is None:  # an engine that does not stamp its requests
            return
        if metrics.max_tokens_param:
            self.request_params_max_tokens.labels(name).observe(metrics.max_tokens_param)
        for histogram, seconds in (
            (self.queue_time, metrics.queue_time),
            (self.prefill_time, metrics.prefill_time),
            (self.decode_time, metrics.decode_time),
            (self.inference_time, metrics.inference_time),
        ):
            if seconds is not None:
                histogram.labels(name).observe(seconds)
        # The first token belongs to prefill. With n > 1 the decode span ends at the latest choice, which
        # is in practice the longest one, so its token count is the divisor. vLLM observes 0 for a
        # one-token request; with no decode there is no time per output token to report, so we skip it.
        if metrics.decode_time is not None and max_choice_tokens > 1:
            self.tpot.labels(name).observe(metrics.decode_time / (max_choice_tokens - 1))
