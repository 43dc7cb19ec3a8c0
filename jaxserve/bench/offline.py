"""`jaxserve bench offline`: engine throughput without HTTP, in waves of C concurrent sequences.

Each wave submits C requests of `input_len` random prompt tokens, generating exactly `output_len`
tokens each (EOS ignored), and times the wave from submission to the last token.
"""

import contextlib
import json
import multiprocessing
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from jaxserve.allocator import loaded_allocator
from jaxserve.config import EngineConfig, OfflineBenchConfig
from jaxserve.engine.core_process import CORE_PROCESS_NAME
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class WaveResult:
    concurrency: int
    output_tokens: int
    seconds: float
    output_tokens_per_s: float
    mean_ttft_ms: float
    mean_tpot_ms: float  # time per output token after the first, per sequence


def run_wave(
    engine: LLMEngine, concurrency: int, input_len: int, output_len: int, rng: np.random.Generator,
    repetition_penalty: float = 1.0,
) -> WaveResult:
    """`concurrency` greedy requests of random prompts at once, each exactly `output_len` tokens (with
    `repetition_penalty`, as a model's generation config may set it for every request)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            repetition_penalty=repetition_penalty)
    start = time.perf_counter()
    first_token: dict[str, float] = {}
    done: dict[str, float] = {}
    for i in range(concurrency):
        prompt = rng.integers(100, engine.vocab_size - 100, size=input_len).tolist()
        engine.add_request(f"bench-{concurrency}-{i}", prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            now = time.perf_counter()
            first_token.setdefault(output.request_id, now)
            if output.finished:
                done[output.request_id] = now
    elapsed = time.perf_counter() - start
    ttft = [first_token[r] - start for r in done]
    tpot = [(done[r] - first_token[r]) / max(output_len - 1, 1) for r in done]
    num_tokens = concurrency * output_len
    return WaveResult(
        concurrency=concurrency,
        output_tokens=num_tokens,
        seconds=elapsed,
        output_tokens_per_s=num_tokens / elapsed,
        mean_ttft_ms=1000 * float(np.mean(ttft)),
        mean_tpot_ms=1000 * float(np.mean(tpot)),
    )


def peak_rss_gib() -> float:
    """The peak resident memory of this process and of the engine's core processes (`--engine-process`, each
    data-parallel rank), read while they run."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    for child in multiprocessing.active_children():
        if child.name.startswith(CORE_PROCESS_NAME):
            with contextlib.suppress(OSError):  # it ended meanwhile
                status = Path(f"/proc/{child.pid}/status").read_text()
                kib += next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
    return kib / 2**20


def run_offline_benchmark(
    engine: LLMEngine, concurrencies: list[int], input_len: int, output_len: int, seed: int = 0
) -> list[dict]:
    rng = np.random.default_rng(seed)
    run_wave(engine, 1, input_len, 4, rng)  # touch every code path once before timing
    return [asdict(run_wave(engine, c, input_len, output_len, rng)) for c in concurrencies]


def main(config: OfflineBenchConfig, engine_config: Callable[[], EngineConfig]) -> None:
    """The command: builds the engine (`engine_config` is called inside the start-up it times: choosing the
    platform's preset starts jax's backend), runs the waves, prints a table and writes `config.json`."""
    start = time.perf_counter()
    engine = LLMEngine(engine_config())
    startup = time.perf_counter() - start
    if config.profile:
        return _profile(engine, config)
    results = run_offline_benchmark(engine, list(config.concurrency), config.input_len, config.output_len)
    report = {
        "model": engine.info.model_name,
        "dtype": engine.info.dtype,
        "weight_dtype": engine.info.weight_dtype,
        "async_scheduling": engine.async_scheduling,
        "allocator": loaded_allocator(),
        "startup_s": round(startup, 1),
        "warmup_s": round(engine.warmup_seconds, 1),
        "peak_rss_gib": round(peak_rss_gib(), 2),
        "results": results,
    }
    print(f"model {report['model']} dtype {report['dtype']} (weights {report['weight_dtype']})  "
          f"start-up {startup:.1f}s (warm-up {engine.warmup_seconds:.1f}s)  peak RSS {report['peak_rss_gib']} GiB  "
          f"allocator {report['allocator']}")
    print(f"{'seqs':>5} {'out tok/s':>10} {'TPOT ms':>8} {'TTFT ms':>8} {'wall s':>7}")
    for r in results:
        print(f"{r['concurrency']:>5} {r['output_tokens_per_s']:>10.1f} {r['mean_tpot_ms']:>8.1f} "
              f"{r['mean_ttft_ms']:>8.1f} {r['seconds']:>7.1f}")
    if config.json:
        with open(config.json, "w") as f:
            json.dump(report, f, indent=2)


def _profile(engine: LLMEngine, config: OfflineBenchConfig) -> None:
    from jaxserve.bench import step_profile

    profiler = step_profile.StepProfiler(engine)
    profiles = [profiler.profile(c, config.input_len, config.profile_steps) for c in config.concurrency]
    print(f"model {engine.info.model_name} dtype {engine.info.dtype} (weights {engine.info.weight_dtype})  "
          f"device {profiles[0].device}  async scheduling {'on' if engine.async_scheduling else 'off'}")
    step_profile.print_profiles(profiles)
    if config.json:
        with open(config.json, "w") as f:
            json.dump({"model": engine.info.model_name, "dtype": engine.info.dtype,
                       "weight_dtype": engine.info.weight_dtype, "async_scheduling": engine.async_scheduling,
                       "profiles": step_profile.as_dicts(profiles)}, f, indent=2)
