"""Where a decode step's time goes, on any backend (`jaxserve bench offline --profile`).

C sequences are brought to steady decode (every one decoding), then K decode steps are timed with the
engine's own phases recorded in place, by wrapping the methods of this engine's instances (nothing global):

- schedule: `Scheduler.schedule()`
- build: `ModelRunner.launch()` without its dispatch (the persistent rows, the batch, its packing)
- dispatch: `ModelRunner.run_step()`: the compiled call until it returns
- device: waiting until the step's sampled tokens are ready (the device's share, as the host sees it)
- read: `ModelRunner.collect()` once they are ready (the copy to the host, per-request results)
- frontend: `OutputProcessor.process()` (detokenizing, stop strings, outputs)
- rest: everything else in `LLMEngine.step()` (`Scheduler.update`, the core's outputs)
- gap: how long the device sat idle between two steps as the host sees it: from a step's results being
  ready to the next step's dispatch returning (0 when the next step was launched before, as with async
  scheduling).

Each figure is a median over the K steps; "host" is the step's wall time minus the device wait. With
multi-step decoding (`--num-scheduler-steps k`) an engine step runs k decode steps, and its figures are
divided by the decode steps it ran: they stay per decode step (per token of each sequence). Then, where
the backend records one, a `jax.profiler` trace of a few more steps gives the kernels (device ops) per step
and the longest ones. The step's roofline (`jaxserve.roofline`, with the device's figures from
`jaxserve.device`) says what the hardware allows and which fraction of it the step reached.
"""

import glob
import gzip
import json
import math
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import jax
import numpy as np

from jaxserve.device import local_facts
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.models.quantization import layer_matmul_dtype, layer_weight_itemsize
from jaxserve.roofline import model_shape, step_cost
from jaxserve.sampling_params import SamplingParams

PHASES = ("schedule", "build", "dispatch", "device", "read", "frontend", "rest")


@dataclass
class StepProfile:
    concurrency: int
    num_steps: int
    median_ms: dict[str, float]  # PHASES, "host", "gap" and "step"
    kernels_per_step: float | None = None  # from the trace; None where the backend records no device ops
    top_kernels: list[tuple[str, float]] = field(default_factory=list)  # (name, ms per step), longest first
    roofline_ms: float | None = None  # what the step's bytes and flops take at the device's peaks
    roofline_fraction: float | None = None  # roofline / measured step
    bound: str | None = None  # "memory" or "compute"
    device: str = ""


class _Clock:
    """Phase times of the step being measured, wrapped around one engine's instances."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = defaultdict(float)
        self.last_dispatch_end = 0.0
        self.launched: list[tuple[Any, float]] = []  # (launched step, its dispatch's end), in launch order
        self.ready: dict[int, float] = {}  # id of a launched step -> when its tokens were ready
        self.decode_steps = 0  # decode steps launched (a multi-step decode's k count k)

    def timed(self, name: str, fn: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.phases[name] += time.perf_counter() - start
        return wrapper


def _instrument(engine: LLMEngine, clock: _Clock) -> None:
    runner, scheduler = engine.runner, engine.scheduler
    scheduler.schedule = clock.timed("schedule", scheduler.schedule)
    engine.outputs.process = clock.timed("frontend", engine.outputs.process)
    run_step, launch = runner.run_step, runner.launch

    def timed_run_step(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = run_step(*args, **kwargs)
        end = time.perf_counter()
        clock.phases["dispatch"] += end - start
        clock.last_dispatch_end = end
        return result

    def timed_launch(*args: Any, **kwargs: Any) -> Any:
        start, dispatched = time.perf_counter(), clock.phases["dispatch"]
        try:
            launched = launch(*args, **kwargs)
        finally:  # the launch less its dispatch
            clock.phases["build"] += time.perf_counter() - start - (clock.phases["dispatch"] - dispatched)
        if launched is not None:
            clock.launched.append((launched, clock.last_dispatch_end))
            clock.decode_steps += launched.scheduler_output.num_steps
        return launched

    def timed_collect(collect: Callable) -> Callable:
        def wrapper(launched: Any) -> Any:
            start = time.perf_counter()
            jax.block_until_ready(launched.sampled.tokens)
            ready = time.perf_counter()
            clock.ready[id(launched)] = ready
            clock.phases["device"] += ready - start
            output = collect(launched)
            clock.phases["read"] += time.perf_counter() - ready
            return output
        return wrapper

    runner.run_step, runner.launch = timed_run_step, timed_launch
    runner.collect, runner.collect_steps = timed_collect(runner.collect), timed_collect(runner.collect_steps)


def _steady(engine: LLMEngine, concurrency: int, input_len: int, num_steps: int, seed: int) -> None:
    """Adds `concurrency` requests long enough for the profile and steps until every one decodes."""
    rng = np.random.default_rng(seed)
    max_tokens = max(4, engine.runner.num_decode_steps) * num_steps + 64  # k tokens per engine step at most
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(concurrency):
        prompt = rng.integers(100, min(engine.vocab_size, len(engine.tokenizer)) - 100, size=input_len).tolist()
        engine.add_request(f"profile-{concurrency}-{i}", prompt, params)
    for _ in range(10_000):
        engine.step()
        last = engine.runner.last_step
        if last is not None and last.bucket.decode_only and last.num_reqs == concurrency:
            return
    raise RuntimeError(f"{concurrency} sequences never reached a decode-only step")


class StepProfiler:
    """Profiles one engine's decode steps (module docstring); its instances are instrumented once, here.
    The engine's core must run in this process."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.clock = _Clock()
        _instrument(engine, self.clock)

    def profile(self, concurrency: int, input_len: int = 128, num_steps: int = 32, trace_steps: int = 8,
                seed: int = 0) -> StepProfile:
        engine, clock = self.engine, self.clock
        _steady(engine, concurrency, input_len, num_steps + trace_steps, seed)
        clock.launched.clear()
        clock.ready.clear()
        rows = []
        for _ in range(num_steps):
            clock.phases.clear()
            clock.decode_steps = 0
            start = time.perf_counter()
            engine.step()
            total = time.perf_counter() - start
            row = {name: clock.phases.get(name, 0.0) for name in PHASES}
            row["rest"] = total - sum(row.values())
            row["host"] = total - row["device"]
            row["step"] = total
            per = max(1, clock.decode_steps)  # per decode step
            rows.append({key: value / per for key, value in row.items()})
        # Idle from step N's tokens being ready to step N + 1's dispatch (async scheduling dispatches N + 1
        # before N is read: no gap then).
        gaps = [max(0.0, next_end - clock.ready[id(step)]) / step.scheduler_output.num_steps
                for (step, _), (_, next_end) in zip(clock.launched, clock.launched[1:], strict=False)
                if id(step) in clock.ready]
        clock.launched.clear()
        median = {key: 1e3 * statistics.median(r[key] for r in rows) for key in rows[0]}
        median["gap"] = 1e3 * statistics.median(gaps) if gaps else 0.0
        profile = StepProfile(concurrency, num_steps, {k: round(v, 4) for k, v in median.items()})
        profile.kernels_per_step, profile.top_kernels = _trace_kernels(engine, clock, trace_steps)
        _add_roofline(profile, engine, concurrency, input_len + num_steps // 2)
        engine.abort_request([f"profile-{concurrency}-{i}" for i in range(concurrency)])
        while engine.core.has_unfinished():  # a step still in flight (async scheduling)
            engine.step()
        return profile


def _trace_kernels(engine: LLMEngine, clock: _Clock, num_steps: int) -> tuple[float | None, list[tuple[str, float]]]:
    """Device ops per decode step and the longest ones (ms per decode step), from a `jax.profiler` trace of
    `num_steps` engine steps; (None, []) where the trace holds no device ops."""
    clock.decode_steps = 0
    with tempfile.TemporaryDirectory(prefix="jaxserve-trace-") as log_dir:
        jax.profiler.start_trace(log_dir, create_perfetto_trace=True)
        try:
            for _ in range(num_steps):
                engine.step()
            jax.block_until_ready(engine.runner.kv_caches)
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(f"{log_dir}/**/*.trace.json.gz", recursive=True)
        if not files:
            return None, []
        with gzip.open(files[0]) as f:
            trace = json.load(f)
    return device_ops(trace, max(1, clock.decode_steps))


def device_ops(trace: dict, num_steps: int) -> tuple[float | None, list[tuple[str, float]]]:
    """(ops per step, [(name, ms per step)] longest first) of a Chrome/Perfetto trace's device timelines:
    the processes named for a GPU (kernels on its streams) or, on a CPU, the XLA op timeline."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, name in names.items() if "/device:" in name}
    ops = [e for e in events if e.get("ph") == "X" and e.get("pid") in device_pids]
    if not ops:
        return None, []
    totals: Counter = Counter()
    for e in ops:
        totals[e["name"]] += e.get("dur", 0.0) / 1e3  # us -> ms
    top = [(name, round(ms / num_steps, 4)) for name, ms in totals.most_common(8)]
    return round(len(ops) / num_steps, 1), top


def _add_roofline(profile: StepProfile, engine: LLMEngine, num_seqs: int, context_len: int) -> None:
    facts = local_facts()
    model = engine.model
    num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(model.state))
    itemsize = np.dtype(model.weight_dtype).itemsize
    rows = engine.runner.ladder.pick(num_seqs, num_seqs).num_tokens  # the decode step's bucket, padded
    layer_dtype = layer_matmul_dtype(model.state, rows, model.cfg.attention)
    cost = step_cost(model_shape(num_params, model.cfg), num_seqs, num_seqs, context_len, itemsize,
                     facts.peak_flops_for(np.dtype(model.weight_dtype).name), facts.memory_bandwidth,
                     layer_itemsize=layer_weight_itemsize(model.quantization),
                     layer_peak_flops=facts.peak_flops_for(layer_dtype) if layer_dtype else None)
    profile.device = facts.name
    if cost.seconds is not None:
        profile.roofline_ms = round(cost.seconds * 1e3, 4)
        profile.roofline_fraction = round(cost.seconds * 1e3 / profile.median_ms["step"], 3)
        profile.bound = cost.bound


def print_profiles(profiles: list[StepProfile]) -> None:
    keys = [*PHASES, "host", "gap", "step"]
    print("per decode step, ms (medians): " + ", ".join(keys))
    print(f"{'seqs':>5} " + " ".join(f"{k:>9}" for k in keys) + f" {'kernels':>8} {'roofline':>9} {'fraction':>8}")
    for p in profiles:
        kernels = f"{p.kernels_per_step:8.1f}" if p.kernels_per_step is not None else f"{'n/a':>8}"
        roofline = f"{p.roofline_ms:9.3f}" if p.roofline_ms is not None else f"{'n/a':>9}"
        fraction = f"{p.roofline_fraction:8.0%}" if p.roofline_fraction is not None else f"{'n/a':>8}"
        print(f"{p.concurrency:>5} " + " ".join(f"{p.median_ms[k]:9.3f}" for k in keys) + f" {kernels} {roofline}"
              f" {fraction}")
    for p in profiles:
        if p.top_kernels:
            print(f"longest device ops at {p.concurrency} sequences (ms per step): "
                  + "; ".join(f"{name[:60]} {ms:.3f}" for name, ms in p.top_kernels[:5]))
    if profiles and profiles[0].roofline_ms is None:
        print(f"roofline: no memory bandwidth or peak known for {profiles[0].device!r} (jaxserve.device)")


def as_dicts(profiles: list[StepProfile]) -> list[dict]:
    return [asdict(p) for p in profiles]
