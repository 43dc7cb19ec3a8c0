"""`jaxserve bench offline`: engine throughput without HTTP, in waves of C concurrent sequences.

Each wave submits C requests of `input_len` random prompt tokens, generating exactly `output_len`
tokens each (EOS ignored), and times the wave from submission to the last token.
"""

import resource
import time
from dataclasses import asdict, dataclass

import numpy as np

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
    engine: LLMEngine, concurrency: int, input_len: int, output_len: int, rng: np.random.Generator
) -> WaveResult:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
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
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def run_offline_benchmark(
    engine: LLMEngine, concurrencies: list[int], input_len: int, output_len: int, seed: int = 0
) -> list[dict]:
    rng = np.random.default_rng(seed)
    run_wave(engine, 1, input_len, 4, rng)  # touch every code path once before timing
    return [asdict(run_wave(engine, c, input_len, output_len, rng)) for c in concurrencies]
