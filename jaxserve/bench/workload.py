"""Workloads for the bucket benchmark: seeded request traces (pure Python and numpy, no jax).

A trace is a list of `TraceRequest(prompt_len, output_len, arrival_s)`. A spec string names one:

    fixed:128,64              every prompt 128 tokens, every output 64
    uniform:32-512,16-256     uniform integer ranges
    sharegpt                  lognormal lengths shaped like ShareGPT chats (prompt mean ~ 230 tokens,
                              output mean ~ 190, long right tails); `sharegpt:MEAN_IN,MEAN_OUT` rescales
    path/to/trace.jsonl       one JSON object per line: prompt_len, output_len[, arrival_s]

and arrivals are either a Poisson process (`rate`, requests per second) or a closed loop (`concurrency`
requests in flight, each replaced when it finishes; arrival_s is then 0 and the runner keeps the loop).
Lengths are clipped so prompt + output fits `max_model_len`.
"""

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

# ShareGPT (vLLM's benchmark set, after its filtering) has prompt and output lengths that are roughly
# lognormal: medians near 130 and 120 tokens with long tails. sigma is the log-space spread.
_SHAREGPT = {"mean_in": 230.0, "mean_out": 190.0, "sigma_in": 1.0, "sigma_out": 0.9}


@dataclass(frozen=True)
class TraceRequest:
    prompt_len: int
    output_len: int
    arrival_s: float = 0.0


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[TraceRequest, ...]
    concurrency: int | None = None  # closed loop; None: open loop with each request's arrival_s

    def to_jsonl(self, path: str | Path) -> None:
        Path(path).write_text("".join(json.dumps(asdict(r)) + "\n" for r in self.requests))

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)


def _lengths(spec: str, num: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    kind, _, args = spec.partition(":")
    if kind == "fixed":
        p, o = (int(x) for x in args.split(","))
        return np.full(num, p), np.full(num, o)
    if kind == "uniform":
        (p_lo, p_hi), (o_lo, o_hi) = ((int(y) for y in x.split("-")) for x in args.split(","))
        return rng.integers(p_lo, p_hi + 1, num), rng.integers(o_lo, o_hi + 1, num)
    if kind == "sharegpt":
        mean_in, mean_out = (float(x) for x in args.split(",")) if args else (_SHAREGPT["mean_in"],
                                                                             _SHAREGPT["mean_out"])

        def lognormal(mean: float, sigma: float) -> np.ndarray:  # E[X] = exp(mu + sigma^2 / 2) = mean
            return rng.lognormal(math.log(mean) - sigma**2 / 2, sigma, num)

        return np.ceil(lognormal(mean_in, _SHAREGPT["sigma_in"])), np.ceil(lognormal(mean_out, _SHAREGPT["sigma_out"]))
    raise ValueError(f"unknown workload {spec!r}: fixed:P,O | uniform:P1-P2,O1-O2 | sharegpt[:MEAN_IN,MEAN_OUT] | "
                     "a .jsonl file")


def make_workload(
    spec: str,
    num_requests: int = 200,
    rate: float | None = None,
    concurrency: int | None = None,
    max_model_len: int = 2048,
    seed: int = 0,
) -> Workload:
    """A reproducible trace from a spec (see the module docstring). A .jsonl file keeps its own arrivals
    unless `rate` or `concurrency` is given."""
    if (rate is None) == (concurrency is None) and not spec.endswith(".jsonl"):
        raise ValueError("give exactly one of rate (requests/s, open loop) and concurrency (closed loop)")
    rng = np.random.default_rng(seed)
    if spec.endswith(".jsonl"):
        rows = [json.loads(line) for line in Path(spec).read_text().splitlines() if line.strip()]
        prompt = np.array([r["prompt_len"] for r in rows])
        output = np.array([r["output_len"] for r in rows])
        arrivals = np.array([float(r.get("arrival_s", 0.0)) for r in rows])
    else:
        prompt, output = _lengths(spec, num_requests, rng)
        arrivals = np.zeros(num_requests)
    if rate is not None:
        arrivals = np.cumsum(rng.exponential(1.0 / rate, len(prompt)))
    elif concurrency is not None:
        arrivals = np.zeros(len(prompt))
    prompt = np.clip(prompt, 1, max_model_len - 1).astype(int)
    output = np.clip(output, 1, max_model_len - prompt).astype(int)
    requests = tuple(TraceRequest(int(p), int(o), float(a)) for p, o, a in zip(prompt, output, arrivals, strict=True))
    arrival = f"rate {rate}/s" if rate is not None else (f"concurrency {concurrency}" if concurrency else "file")
    return Workload(f"{Path(spec).name if spec.endswith('.jsonl') else spec} @ {arrival}", requests, concurrency)
