"""`jaxserve bench serve`: an HTTP load generator in the manner of `vllm bench serve`.

Each request streams /v1/completions with a prompt of exactly `input_len` random token ids (after a
`prefix_len`-token prefix that every request shares, as a system prompt is) and `ignore_eos`, so it
yields exactly `output_len` tokens (with `range_ratio`, each request's lengths drawn around those, as
vLLM's random dataset draws them); the server's reported cached prompt tokens are counted. Requests are
sent at `request_rate` per second on vLLM's schedule (`arrival_offsets`; inf: all at once), and at most
`concurrency` are in flight (None: no cap): one that arrives with that many in flight waits for one to
finish, and its latencies count from when it is sent, as vLLM counts them.
TTFT is the first streamed token, ITL the gaps between tokens, TPOT (E2E - TTFT) / (tokens - 1).
"""

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from jaxserve.config import ServeBenchConfig

# Random prompt ids come from this range: past the special tokens of common vocabularies (GPT-2's
# 50257, SmolLM2's 49152, Llama 3's 128256).
_TOKEN_RANGE = (1000, 30000)


@dataclass
class RequestResult:
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None


async def _one_request(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], body: dict
) -> RequestResult:
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.num_output_tokens = chunk["usage"]["completion_tokens"]
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    result.num_cached_tokens = details.get("cached_tokens") or 0
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if result.ttft_s == 0.0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
    except httpx.HTTPError as e:
        result.error = repr(e)
    result.e2e_s = time.perf_counter() - start
    return result


def arrival_offsets(num_prompts: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each request is sent, in seconds from the start, as vLLM's `bench serve` schedules them: a gap
    before each request (the first too) drawn from a gamma distribution of shape `burstiness` and mean
    1 / `request_rate` (burstiness 1: exponential gaps, a Poisson process), the sums then scaled so that the
    last request goes at exactly num_prompts / request_rate, which steadies the offered rate across seeds.
    An infinite rate sends every request at once."""
    if math.isinf(request_rate):
        return [0.0] * num_prompts
    rng = np.random.default_rng(seed)
    offsets = np.cumsum(rng.gamma(burstiness, 1.0 / (request_rate * burstiness), num_prompts))
    return (offsets * (num_prompts / request_rate / offsets[-1])).tolist()


def _drawn_length(rng: random.Random, length: int, range_ratio: float, least: int = 0) -> int:
    """A length drawn uniformly from [length (1 - r), length (1 + r)], at least `least` (vLLM's random
    dataset); `length` itself, drawing nothing, where r is 0."""
    if range_ratio == 0:
        return length
    low, high = math.floor(length * (1 - range_ratio)), math.ceil(length * (1 + range_ratio))
    return rng.randint(max(least, low), max(least, high))


def _percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    array = np.asarray(values) * scale
    return {"mean": float(array.mean()), "p50": float(np.percentile(array, 50)), "p99": float(np.percentile(array, 99))}


async def run_level(
    base_url: str,
    model: str | None,
    concurrency: int | None,
    num_prompts: int,
    input_len: int,
    output_len: int,
    api_key: str | None = None,
    seed: int = 0,
    prefix_len: int = 0,
    sampling: dict[str, float | int | None] | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    range_ratio: float = 0.0,
) -> dict:
    """Sends `num_prompts` requests at `request_rate` per second, at most `concurrency` in flight (None: no
    cap); returns the vLLM-style summary. `sampling`: fields sent with every request (those set to None are
    left out); greedy by default. `range_ratio`: each request's lengths drawn uniformly within that fraction
    of `input_len` and `output_len`, either side (vLLM's random dataset)."""
    if not request_rate > 0 or not burstiness > 0:
        raise ValueError(f"request_rate and burstiness must be > 0 (inf: all at once), got {request_rate}, "
                         f"{burstiness}")
    sampling = {key: value for key, value in (sampling or {"temperature": 0.0}).items() if value is not None}
    rng = random.Random(seed)
    prefix = [rng.randrange(*_TOKEN_RANGE) for _ in range(prefix_len)]
    url = f"{base_url.rstrip('/')}/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    input_lens = [_drawn_length(rng, input_len, range_ratio) for _ in range(num_prompts)]
    bodies = [
        {
            **({"model": model} if model else {}),
            "prompt": prefix + [rng.randrange(*_TOKEN_RANGE) for _ in range(length)],
            "max_tokens": _drawn_length(rng, output_len, range_ratio, least=1), "ignore_eos": True, **sampling,
            "stream": True, "stream_options": {"include_usage": True},
        }
        for length in input_lens
    ]
    in_flight = concurrency or num_prompts
    limit = asyncio.Semaphore(in_flight)
    timeout = httpx.Timeout(None, connect=30.0)
    # A connection per request: some servers (llama-server) drop idle kept-alive connections, and a request
    # sent on one fails before reaching them. A local connect costs well under a millisecond.
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def bounded(body: dict, offset: float) -> RequestResult:
            await asyncio.sleep(offset - (time.perf_counter() - start))  # its arrival; a negative wait is none
            async with limit:
                return await _one_request(client, url, headers, body)

        start = time.perf_counter()
        offsets = arrival_offsets(num_prompts, request_rate, burstiness, seed)
        results = await asyncio.gather(*(bounded(b, t) for b, t in zip(bodies, offsets, strict=True)))
        duration = time.perf_counter() - start
    ok = [r for r in results if r.error is None]
    num_output = sum(r.num_output_tokens for r in ok)
    num_prompt = sum(prefix_len + length for r, length in zip(results, input_lens, strict=True) if r.error is None)
    tpot = [(r.e2e_s - r.ttft_s) / (r.num_output_tokens - 1) for r in ok if r.num_output_tokens > 1]
    return {
        "concurrency": concurrency,
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",  # vLLM's JSON: strict JSON
        "burstiness": burstiness,
        "num_prompts": num_prompts,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_tokens_per_s": num_output / duration,
        "total_tokens_per_s": (num_output + num_prompt) / duration,
        "prompt_tokens": num_prompt,
        "cached_prompt_tokens": sum(r.num_cached_tokens for r in ok),
        "ttft_ms": _percentiles([r.ttft_s for r in ok]),
        "tpot_ms": _percentiles(tpot),
        "itl_ms": _percentiles([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": _percentiles([r.e2e_s for r in ok]),
    }


def format_report(results: list[dict]) -> str:
    lines = [
        f"{'conc':>5} {'req/s':>7} {'out tok/s':>10} "
        + " ".join(f"{m + ' ' + s:>12}" for m in ("TTFT", "TPOT", "ITL", "E2E") for s in ("mean", "p50", "p99"))
        + f" {'rate':>6}"
    ]
    for r in results:
        row = f"{r['concurrency'] or '-':>5} {r['request_throughput']:>7.2f} {r['output_tokens_per_s']:>10.1f} "
        row += " ".join(f"{r[m][s]:>12.1f}" for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
                        for s in ("mean", "p50", "p99"))
        row += f" {r['request_rate']:>6}"  # requests sent per second (inf: all at once)
        if r["failed"]:
            row += f"   ({r['failed']} failed: {r['errors']})"
        lines.append(row)
    lines.append("(latencies in ms)")
    return "\n".join(lines)


def main(config: ServeBenchConfig) -> None:
    """The command: one level per `config.concurrency`, each row printed as soon as it is measured (after
    the header), the results written to `config.json`."""
    header, footer = format_report([]).splitlines()  # no rows: the header and the footnote
    print(header, flush=True)
    results = []
    for concurrency in config.levels:
        num_prompts = config.prompts_per_level(concurrency)
        sampling = {"temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k,
                    "min_p": config.min_p}
        results.append(asyncio.run(run_level(
            config.openai_base_url, config.model, concurrency, num_prompts, config.input_len, config.output_len,
            api_key=config.api_key, seed=config.seed, prefix_len=config.prefix_len, sampling=sampling,
            request_rate=config.request_rate, burstiness=config.burstiness, range_ratio=config.range_ratio,
        )))
        print("\n".join(format_report(results[-1:]).splitlines()[1:-1]), flush=True)
    print(footer)
    if config.json:
        with open(config.json, "w") as f:
            json.dump(results, f, indent=2, allow_nan=False)
