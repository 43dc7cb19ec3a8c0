"""Drafts for speculative decoding by n-gram lookup (vLLM's "ngram" method, prompt lookup decoding).

A sequence's drafts are the tokens that followed, earlier in its own context (prompt and output), the
longest n-gram that also ends the context, n in [min_n, max_n], at its earliest occurrence, as vLLM picks
it. Output that repeats its context (code edits, quotations, extraction, a summary's names) finds long
runs; free prose finds few, and a decode without drafts is an ordinary decode.

Each sequence's context is kept in a numpy buffer that grows by the tokens appended since the last
proposal, so a proposal costs one comparison over the context and a few over its matches, no copy.
Pure numpy, no jax; one thread (the engine's) uses it.
"""

import numpy as np

from jaxserve.engine.request import Request


def longest_ngram_drafts(context: np.ndarray, min_n: int, max_n: int, max_drafts: int) -> np.ndarray:
    """The up to `max_drafts` tokens that followed the earliest occurrence of the longest n-gram (n in
    [min_n, max_n]) ending `context` (i32[L]) that also occurs earlier in it; empty if none does."""
    length = context.shape[0]
    if length < 2 or max_drafts < 1:
        return context[:0]
    ends = np.flatnonzero(context[: length - 1] == context[length - 1])  # i64[C]: where a match could end
    if not ends.size:
        return context[:0]
    matched = np.ones(ends.shape[0], np.int64)  # [C]: tokens matched backwards from each end
    alive = np.ones(ends.shape[0], np.bool_)  # [C]: still matching
    for back in range(1, max_n):
        alive &= ends >= back
        if not alive.any():
            break
        alive[alive] = context[ends[alive] - back] == context[length - 1 - back]
        matched += alive
    best = int(matched.max())
    if best < min_n:
        return context[:0]
    start = int(ends[np.argmax(matched == best)]) + 1  # the earliest of the longest
    return context[start : start + max_drafts]


class NgramProposer:
    """Per running sequence, its context buffer; `propose` reads the tokens it has not seen yet."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self._contexts: dict[str, tuple[np.ndarray, int]] = {}  # id -> (i32[max_num_tokens], tokens in it)

    probes_cheaply = True  # a proposal costs a lookup: the scheduler may ask one to learn whether drafts come
    last_round_steady = True  # every proposal costs about the same

    def propose_batch(self, requests: list[Request], max_drafts: list[int]) -> list[list[int]]:
        """Each request's drafts (`propose`)."""
        return [self.propose(request, limit) for request, limit in zip(requests, max_drafts, strict=True)]

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_drafts) drafts to follow the request's known tokens."""
        max_drafts = min(max_drafts, self.num_speculative_tokens)
        if max_drafts < 1:
            return []
        buffer, filled = self._contexts.get(request.request_id) or (
            np.empty(request.max_num_tokens, np.int32), 0)
        num_tokens = request.num_tokens
        if num_tokens > filled:
            buffer[filled:num_tokens] = request.token_ids(filled, num_tokens)
            self._contexts[request.request_id] = (buffer, num_tokens)
        return longest_ngram_drafts(buffer[:num_tokens], self.min_n, self.max_n, max_drafts).tolist()

    def finish(self, request: Request) -> None:
        """Drops a finished sequence's buffer."""
        self._contexts.pop(request.request_id, None)
