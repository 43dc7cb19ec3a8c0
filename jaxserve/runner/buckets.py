"""The bucket ladder: which padded shapes exist, which one a step uses, what warm-up compiles (no jax).

A step of `num_tokens` packed tokens from `num_reqs` requests runs in the smallest (tokens, requests)
bucket that holds it. Decode-only steps (one token per request) use square buckets (R, R) so that a
single sequence does not pay for a 32-token matmul, and are marked `decode_only`, which lets attention
use its decode kernel; a mixed step that happens to fill an (R, R) bucket compiles separately.
"""

import bisect
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Bucket:
    num_tokens: int  # T: padded packed tokens
    num_reqs: int  # R: padded requests
    decode_only: bool = False  # every request has one token (so T == R)


@dataclass(frozen=True)
class ExecutedStep:
    """What the runner last ran: its bucket and the real tokens and requests in it."""

    bucket: Bucket
    num_tokens: int
    num_reqs: int


class BucketLadder:
    def __init__(
        self,
        token_buckets: tuple[int, ...],
        request_buckets: tuple[int, ...],
        max_num_batched_tokens: int,
        max_num_seqs: int,
    ) -> None:
        self.token_buckets = _cut(token_buckets, max_num_batched_tokens)
        self.request_buckets = _cut(request_buckets, max_num_seqs)

    def pick(self, num_tokens: int, num_reqs: int) -> Bucket:
        """The bucket for a step; decode-only when every request contributes exactly one token."""
        padded_reqs = _round_up(self.request_buckets, num_reqs)
        if num_tokens == num_reqs:
            return Bucket(padded_reqs, padded_reqs, decode_only=True)
        return Bucket(_round_up(self.token_buckets, num_tokens), padded_reqs)

    def all_buckets(self) -> list[Bucket]:
        """Every bucket `pick` can return: what warm-up compiles."""
        buckets = {Bucket(r, r, decode_only=True) for r in self.request_buckets}
        for t in self.token_buckets:
            previous_r = 0
            for r in self.request_buckets:
                if previous_r < t:  # some num_reqs in (previous_r, r] fits t tokens
                    buckets.add(Bucket(t, r))
                previous_r = r
        return sorted(buckets)


def largest_buckets(buckets: list[Bucket]) -> list[Bucket]:
    """The largest mixed and the largest decode bucket: between them, the step's peak temp memory."""
    mixed = [b for b in buckets if not b.decode_only]
    decode = [b for b in buckets if b.decode_only]
    return [max(group) for group in (mixed, decode) if group]


def _cut(ladder: tuple[int, ...], limit: int) -> tuple[int, ...]:
    """The ladder up to and including the first rung that covers `limit`, that rung capped at it."""
    kept = [b for b in ladder if b < limit]
    return (*kept, limit)


def _round_up(ladder: tuple[int, ...], n: int) -> int:
    index = bisect.bisect_left(ladder, n)
    if index == len(ladder):
        raise ValueError(f"{n} exceeds the largest bucket {ladder[-1]}")
    return ladder[index]
