"""Runs a workload through a bucket ladder, simulated or on the real engine, and accounts for padding.

The scheduler and the page manager are pure Python, so `simulate` drives the real `Scheduler` over a
trace with a stand-in for the device: every step's bucket comes from the real `BucketLadder.pick`, and
its duration from a step-time model (a roofline for a GPU target, or 1 for "steps"). `run_engine` feeds
the same trace to a real `LLMEngine` and records the bucket each step ran in, with wall-clock times.
Both return a `LadderRun`; `padding` turns its steps into the waste figures. Arrivals: each request's
`arrival_s` (open loop), or a closed loop of `workload.concurrency` requests in flight, where a finished
request is replaced before the next step (the same rule in both runners, so they pick the same buckets).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from jaxserve.bench.workload import TraceRequest, Workload
from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.step_io import StepOutput
from jaxserve.runner.buckets import Bucket, BucketLadder
from jaxserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class StepRecord:
    bucket: Bucket
    num_tokens: int  # real tokens in the step
    num_reqs: int  # real requests in the step
    seconds: float
    num_keys: int = 0  # keys the step's requests attend, summed (simulated runs)

    @property
    def decode_only(self) -> bool:
        return self.bucket.decode_only


@dataclass
class LadderRun:
    steps: list[StepRecord] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)  # per request: (e2e - ttft) / (outputs - 1)
    e2e_s: list[float] = field(default_factory=list)
    duration_s: float = 0.0
    num_output_tokens: int = 0

    def summary(self) -> dict:
        def stats(values: list[float]) -> dict[str, float]:
            array = np.asarray(values or [0.0]) * 1000.0
            return {"mean": float(array.mean()), "p50": float(np.percentile(array, 50)),
                    "p99": float(np.percentile(array, 99))}

        return {
            "duration_s": self.duration_s,
            "num_steps": len(self.steps),
            "output_tokens_per_s": self.num_output_tokens / self.duration_s if self.duration_s else 0.0,
            "ttft_ms": stats(self.ttft_s), "tpot_ms": stats(self.tpot_s), "e2e_ms": stats(self.e2e_s),
            "padding": padding(self.steps),
            "bucket_steps": bucket_histogram(self.steps),
        }


def padding(steps: list[StepRecord]) -> dict[str, dict[str, float]]:
    """Padded tokens / real tokens and padded rows / real rows, in total and as the mean over steps,
    for decode-only steps, mixed steps and all."""
    result = {}
    for name, group in (("decode", [s for s in steps if s.decode_only]),
                        ("mixed", [s for s in steps if not s.decode_only]), ("all", steps)):
        real_tokens = sum(s.num_tokens for s in group)
        real_rows = sum(s.num_reqs for s in group)
        padded_tokens = sum(s.bucket.num_tokens - s.num_tokens for s in group)
        padded_rows = sum(s.bucket.num_reqs - s.num_reqs for s in group)
        result[name] = {
            "steps": len(group),
            "real_tokens": real_tokens,
            "padded_tokens": padded_tokens,
            "token_waste": padded_tokens / real_tokens if real_tokens else 0.0,
            "row_waste": padded_rows / real_rows if real_rows else 0.0,
            "mean_step_token_waste": float(np.mean([(s.bucket.num_tokens - s.num_tokens) / s.num_tokens
                                                    for s in group])) if group else 0.0,
            "mean_step_row_waste": float(np.mean([(s.bucket.num_reqs - s.num_reqs) / s.num_reqs
                                                  for s in group])) if group else 0.0,
        }
    return result


def bucket_histogram(steps: list[StepRecord]) -> dict[str, int]:
    """Steps per bucket, keyed "T x R" (decode-only buckets marked "d")."""
    counts: dict[str, int] = {}
    for step in steps:
        key = f"{step.bucket.num_tokens}x{step.bucket.num_reqs}{'d' if step.decode_only else ''}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


class _Arrivals:
    """Which trace requests join before the next step (open loop by time, or a closed loop)."""

    def __init__(self, workload: Workload) -> None:
        self.pending = list(enumerate(workload.requests))
        self.concurrency = workload.concurrency

    def due(self, now: float, num_in_flight: int) -> list[tuple[int, TraceRequest]]:
        if self.concurrency is not None:
            count = max(0, min(self.concurrency - num_in_flight, len(self.pending)))
        else:
            count = next((i for i, (_, r) in enumerate(self.pending) if r.arrival_s > now), len(self.pending))
        due, self.pending = self.pending[:count], self.pending[count:]
        return due

    def next_arrival(self) -> float | None:
        return self.pending[0][1].arrival_s if self.pending and self.concurrency is None else None


class _Latencies:
    def __init__(self) -> None:
        self.arrival: dict[str, float] = {}
        self.first: dict[str, float] = {}

    def record(self, run: LadderRun, request_id: str, num_outputs: int, finished: bool, now: float) -> None:
        self.first.setdefault(request_id, now)
        if finished:
            arrival, first = self.arrival[request_id], self.first[request_id]
            run.ttft_s.append(first - arrival)
            run.e2e_s.append(now - arrival)
            if num_outputs > 1:
                run.tpot_s.append((now - first) / (num_outputs - 1))
            run.num_output_tokens += num_outputs


def simulate(
    workload: Workload,
    ladder: BucketLadder,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_pages: int,
    page_size: int,
    step_seconds: Callable[[Bucket, int], float] = lambda bucket, num_keys: 1.0,
) -> LadderRun:
    """The trace through the real scheduler with a simulated device; `step_seconds(bucket, num_keys)`
    times each step (default: 1, so durations count steps)."""
    scheduler = Scheduler(KVCacheManager(num_pages, page_size, enable_prefix_caching=False), max_num_seqs,
                          max_num_batched_tokens)
    arrivals, latencies, run = _Arrivals(workload), _Latencies(), LadderRun()
    now = 0.0
    while True:
        for index, trace in arrivals.due(now, len(scheduler.requests)):
            request = Request(f"r{index}", [1] * trace.prompt_len, SamplingParams(max_tokens=trace.output_len,
                              ignore_eos=True), eos_token_ids=(), max_model_len=trace.prompt_len + trace.output_len,
                              sampling_seed=0)
            scheduler.add_request(request)
            latencies.arrival[request.request_id] = max(now, trace.arrival_s)
        if not scheduler.has_unfinished():
            upcoming = arrivals.next_arrival()
            if upcoming is None:
                break
            now = upcoming
            continue
        out = scheduler.schedule()
        bucket = ladder.pick(out.num_tokens, out.num_reqs)
        num_keys = sum(out.start_positions) + out.num_tokens
        seconds = step_seconds(bucket, num_keys)
        now += seconds
        run.steps.append(StepRecord(bucket, out.num_tokens, out.num_reqs, seconds, num_keys))
        ids = out.request_ids
        for request in scheduler.update(out, StepOutput(ids, [1] * len(ids), [0.0] * len(ids))):
            latencies.record(run, request.request_id, request.num_output_tokens, request.status.is_finished, now)
    run.duration_s = now
    return run


def run_engine(engine, workload: Workload, seed: int = 0) -> LadderRun:
    """The trace through a real LLMEngine (random prompt tokens, EOS ignored), in wall-clock time."""
    rng = np.random.default_rng(seed)
    arrivals, latencies, run = _Arrivals(workload), _Latencies(), LadderRun()
    start = time.perf_counter()
    num_in_flight = 0
    while True:
        now = time.perf_counter() - start
        for index, trace in arrivals.due(now, num_in_flight):
            prompt = rng.integers(100, engine.vocab_size - 100, size=trace.prompt_len).tolist()
            engine.add_request(f"r{index}", prompt, SamplingParams(temperature=0.0, max_tokens=trace.output_len,
                                                                   ignore_eos=True))
            latencies.arrival[f"r{index}"] = now
            num_in_flight += 1
        if not engine.has_unfinished_requests():
            upcoming = arrivals.next_arrival()
            if upcoming is None:
                break
            time.sleep(max(0.0, upcoming - (time.perf_counter() - start)))
            continue
        step_start = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter() - start
        executed = engine.runner.last_step
        if executed is not None:
            run.steps.append(StepRecord(executed.bucket, executed.num_tokens, executed.num_reqs,
                                        time.perf_counter() - step_start))
        for output in outputs:
            completion = output.outputs[0]
            latencies.record(run, output.request_id, len(completion.token_ids), output.finished, now)
            num_in_flight -= output.finished
    run.duration_s = time.perf_counter() - start
    return run
