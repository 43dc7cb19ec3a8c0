"""Bucket ladders to compare: from presets, YAML files or inline specs; and a search for a good one.

`--suggest` searches ladders for a workload under a bucket budget. Which steps the scheduler runs does
not depend on the ladder (it knows nothing of buckets), so one simulation of the workload gives every
step's real (tokens, requests, keys), and any ladder is scored by padding those steps into its buckets:
predicted seconds on a GPU target, or padded tokens and rows on the CPU. The search is a local search
(add or drop one rung while it helps and fits the budget) from two starts, the smallest ladder and the
powers-of-two ladder cut to the budget, so it never returns worse than powers of two when those fit.
With an open-loop workload, bucket choice moves step times and so arrivals a little; the final numbers
come from a full simulation of the suggested ladder.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from jaxserve.bench.ladder_run import StepRecord
from jaxserve.config import EngineConfig
from jaxserve.runner.buckets import Bucket, BucketLadder


@dataclass(frozen=True)
class LadderSpec:
    name: str
    token_buckets: tuple[int, ...]
    request_buckets: tuple[int, ...]
    max_num_batched_tokens: int
    max_num_seqs: int
    page_size: int = 16

    def ladder(self) -> BucketLadder:
        return BucketLadder(self.token_buckets, self.request_buckets, self.max_num_batched_tokens, self.max_num_seqs)

    @property
    def num_buckets(self) -> int:
        return len(self.ladder().all_buckets())

    def to_yaml(self, comment: str = "") -> str:
        body = {
            "buckets": {"token_buckets": list(self.token_buckets), "request_buckets": list(self.request_buckets)},
            "scheduler": {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens},
            "cache": {"page_size": self.page_size},
        }
        header = "".join(f"# {line}\n" for line in comment.splitlines())
        return header + yaml.safe_dump(body, sort_keys=False, default_flow_style=None)


def load_ladder(spec: str) -> LadderSpec:
    """A preset name (`default`, `cpu`, `gpu`, `buckets/pow2`, ...), a YAML file, or inline
    `tokens=32,128,512;requests=1,4,16,64` (the largest rungs become the step limits)."""
    if "=" in spec:
        fields = dict(part.split("=", 1) for part in spec.split(";") if part)
        tokens = tuple(int(x) for x in fields["tokens"].split(","))
        requests = tuple(int(x) for x in fields["requests"].split(","))
        return LadderSpec(spec, tokens, requests, tokens[-1], requests[-1], int(fields.get("page_size", 16)))
    config = EngineConfig.from_preset(spec)
    return LadderSpec(Path(spec).stem if Path(spec).suffix else spec, config.buckets.token_buckets,
                      config.buckets.request_buckets, config.scheduler.max_num_batched_tokens,
                      config.scheduler.max_num_seqs, config.cache.page_size)


def powers_of_two(limit: int, start: int = 1) -> tuple[int, ...]:
    rungs, x = [], start
    while x < limit:
        rungs.append(x)
        x *= 2
    return (*rungs, limit)


def _candidates(limit: int, start: int) -> list[int]:
    """Rungs worth trying: powers of two and their 1.5x neighbours below the limit."""
    rungs = set()
    x = start
    while x < limit:
        rungs.update({x, x * 3 // 2})
        x *= 2
    return sorted(r for r in rungs if start <= r < limit)


def make_objective(steps: list[StepRecord], step_seconds: Callable[[Bucket, int], float] | None
                   ) -> Callable[[LadderSpec], float]:
    """Scores a ladder on fixed steps: predicted seconds, or (no predictor) padded tokens + padded rows."""
    def score(spec: LadderSpec) -> float:
        ladder, total = spec.ladder(), 0.0
        for step in steps:
            bucket = ladder.pick(step.num_tokens, step.num_reqs)
            if step_seconds is not None:
                total += step_seconds(bucket, step.num_keys)
            else:
                total += bucket.num_tokens - step.num_tokens + bucket.num_reqs - step.num_reqs
        return total

    return score


def suggest_ladder(
    base: LadderSpec,
    steps: list[StepRecord],
    max_buckets: int,
    step_seconds: Callable[[Bucket, int], float] | None = None,
) -> tuple[LadderSpec, float]:
    """The best ladder found within `max_buckets` compiled buckets, with the same step limits as `base`,
    and its score (lower is better)."""
    score = make_objective(steps, step_seconds)
    t_max, r_max = base.max_num_batched_tokens, base.max_num_seqs
    token_pool, request_pool = _candidates(t_max, 16), _candidates(r_max, 1)

    def spec(tokens: set[int], requests: set[int]) -> LadderSpec:
        return LadderSpec("suggested", tuple(sorted(tokens | {t_max})), tuple(sorted(requests | {r_max})),
                          t_max, r_max, base.page_size)

    def improve(tokens: set[int], requests: set[int]) -> tuple[LadderSpec, float]:
        best, best_score = spec(tokens, requests), score(spec(tokens, requests))
        while True:
            moves = [(tokens ^ {t}, requests) for t in token_pool] + [(tokens, requests ^ {r}) for r in request_pool]
            scored = [(score(s), s) for s in (spec(*m) for m in moves) if s.num_buckets <= max_buckets]
            if not scored:
                return best, best_score
            candidate_score, candidate = min(scored, key=lambda x: x[0])
            if candidate_score >= best_score:
                return best, best_score
            best, best_score = candidate, candidate_score
            tokens, requests = set(candidate.token_buckets) - {t_max}, set(candidate.request_buckets) - {r_max}

    starts = [(set(), set())]
    pow2_tokens, pow2_requests = set(powers_of_two(t_max, 32)[:-1]), set(powers_of_two(r_max)[:-1])
    while pow2_tokens and spec(pow2_tokens, pow2_requests).num_buckets > max_buckets:
        pow2_tokens.discard(min(pow2_tokens))  # cut the smallest rungs until the ladder fits
    if spec(pow2_tokens, pow2_requests).num_buckets <= max_buckets:
        starts.append((pow2_tokens, pow2_requests))
    return min((improve(*start) for start in starts), key=lambda x: x[1])
