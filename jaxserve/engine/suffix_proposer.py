"""Drafts for speculative decoding from suffix matches (vLLM's "suffix" method: SuffixDecoding).

Two corpora are searched: the sequence's own context (its prompt and output), and the outputs of recent
finished requests (`OutputCache`, vLLM's global suffix tree). In each, a proposal takes the longest suffix of
the context, at most `max_tree_depth` tokens, that occurs earlier (m tokens long; every one of its
occurrences), and follows those occurrences forward as a walk down a suffix tree would: at each step the
token that most of the still-agreeing occurrences continue with, its probability the fraction of them that
do (those that end count against it), the path's probability the product of those. The path stops where its
probability falls below `min_token_prob`, or after `max_spec_factor * m` tokens (longer matches earn longer
drafts), or at the request's limit. Of the two corpora's paths, the one with the larger expected number of
accepted tokens (the sum of its prefixes' probabilities) is proposed.

That is what suffix trees of the two corpora give, found without building them: a tree holds a node per
position and depth, where the occurrences are found in the context by one vectorized comparison (as the n-gram
proposer finds its matches) and in the output cache through an index of its token pairs.

A request with a `cache_salt` neither reads nor adds to the output cache (whether drafts are accepted would
tell one tenant of another's outputs); its own context still drafts.

Pure numpy and Python, no jax; one thread (the engine's) uses it.
"""

import bisect
from collections import deque

import numpy as np

from jaxserve.engine.request import Request

# The output cache's tokens at most, whatever `max_cached_requests` allows (its index costs some 40 bytes a
# token): the oldest outputs leave first.
MAX_CACHED_TOKENS = 1 << 20
# The latest occurrences of a token pair that a lookup in the output cache follows, at most.
MAX_CANDIDATES = 256
_END = -1  # between two cached outputs: matches no token, and ends a path


def follow_longest_match(corpus: np.ndarray, ends: np.ndarray, pattern: np.ndarray, max_spec_factor: float,
                         min_token_prob: float, max_drafts: int, live: tuple[int, int] | None = None
                         ) -> tuple[list[int], float]:
    """The drafts that follow the longest suffix of `pattern` (i32[P]) among its occurrences in `corpus`
    (i32[N]) that end at `ends` (i64[C]: positions where the corpus holds pattern[-1]), walked as the module
    docstring says, and the path's expected number of accepted tokens. Positions are absolute: position p is
    corpus[p % N], and only those in `live`'s [first, end) are read (default: all of the corpus)."""
    if not ends.size or max_drafts < 1:
        return [], 0.0
    size = corpus.shape[0]
    first, end = live if live is not None else (0, size)
    matched = np.ones(ends.shape[0], np.int64)  # [C]: tokens matched backwards from each end
    alive = np.ones(ends.shape[0], np.bool_)  # [C]: still matching
    for back in range(1, pattern.shape[0]):
        alive &= ends - back >= first
        if not alive.any():
            break
        alive[alive] = corpus[(ends[alive] - back) % size] == pattern[-1 - back]
        matched += alive
    longest = int(matched.max())
    limit = min(max_drafts, int(max_spec_factor * longest))
    nexts = ends[matched == longest] + 1  # [O]: where each occurrence of the longest match continues
    drafts: list[int] = []
    probability, expected = 1.0, 0.0
    while len(drafts) < limit:
        if nexts.shape[0] == 1:  # one occurrence: its tokens, each a certainty, up to an end
            run = corpus[np.arange(nexts[0], min(nexts[0] + limit - len(drafts), end)) % size]
            stop = np.flatnonzero(run == _END)
            run = run[: stop[0]] if stop.size else run
            drafts += run.tolist()
            return drafts, expected + probability * run.shape[0]
        tokens = np.where(nexts < end, corpus[nexts % size], _END)  # [O]: each occurrence's next token
        values, counts = np.unique(tokens[tokens != _END], return_counts=True)
        if not values.size:
            break
        best = int(np.argmax(counts))  # the most frequent continuation (the smallest id of a tie)
        probability *= counts[best] / tokens.shape[0]
        if probability < min_token_prob:
            break
        drafts.append(int(values[best]))
        expected += probability
        nexts = nexts[tokens == values[best]] + 1
    return drafts, expected


class OutputCache:
    """The outputs of recent finished requests, up to `max_requests` of them and MAX_CACHED_TOKENS tokens,
    with `_END` after each, in a ring of tokens addressed by absolute position (the position of a token
    ever added), and an index from each token pair to the positions where the pair ends."""

    def __init__(self, max_requests: int, max_tokens: int = MAX_CACHED_TOKENS) -> None:
        self.max_requests = max_requests
        self._ring = np.full(max_tokens, _END, np.int32)  # i32[T]: the token at absolute position p is at p % T
        self._total = 0  # tokens ever added (the next absolute position)
        self._starts: deque[int] = deque()  # each cached output's first position, oldest first
        self._pairs: dict[tuple[int, int], list[int]] = {}  # (a, b) -> ascending positions of b after a
        self._sweep: list[tuple[int, int]] = []  # pairs whose dead positions the next additions trim

    @property
    def num_requests(self) -> int:
        return len(self._starts)

    @property
    def _first_live(self) -> int:
        """The first position still cached: the oldest cached output's start (the ring holds it)."""
        return self._starts[0] if self._starts else self._total

    def add(self, tokens: np.ndarray) -> None:
        """Caches one output (i32[n]), evicting the oldest where the requests or the ring overflow."""
        size = self._ring.shape[0]
        tokens = tokens[-(size - 1) :]  # an output longer than the ring keeps its end
        if self.max_requests < 1 or not tokens.size:
            return
        start = self._total
        index = (start + np.arange(tokens.shape[0] + 1)) % size
        self._ring[index] = np.append(tokens, _END)
        self._total += tokens.shape[0] + 1
        self._starts.append(start)
        while len(self._starts) > self.max_requests or self._starts[0] < self._total - size:
            self._starts.popleft()
        previous = tokens[:-1].tolist()
        for offset, (first, second) in enumerate(zip(previous, tokens[1:].tolist(), strict=True)):
            self._pairs.setdefault((first, second), []).append(start + offset + 1)
        self._trim_some(2 * tokens.shape[0])

    def _trim_some(self, budget: int) -> None:
        """Trims the dead positions of up to `budget` pairs (each pair is trimmed once per pass over all of
        them), dropping pairs left empty: the index stays about as large as what is cached."""
        first_live = self._first_live
        for _ in range(budget):
            if not self._sweep:
                self._sweep = list(self._pairs)
                if not self._sweep:
                    return
            pair = self._sweep.pop()
            positions = self._pairs.get(pair)
            if positions is not None:
                del positions[: bisect.bisect_left(positions, first_live)]
                if not positions:
                    del self._pairs[pair]

    def propose(self, pattern: np.ndarray, max_spec_factor: float, min_token_prob: float,
                max_drafts: int) -> tuple[list[int], float]:
        """`follow_longest_match` over the cached outputs, from the latest MAX_CANDIDATES occurrences of the
        pattern's last two tokens."""
        if pattern.shape[0] < 2 or not self._starts:
            return [], 0.0
        positions = self._pairs.get((int(pattern[-2]), int(pattern[-1])))
        if not positions:
            return [], 0.0
        first_live = self._first_live
        del positions[: bisect.bisect_left(positions, first_live)]
        if not positions:
            return [], 0.0
        return follow_longest_match(self._ring, np.asarray(positions[-MAX_CANDIDATES:], np.int64), pattern,
                                    max_spec_factor, min_token_prob, max_drafts, (first_live, self._total))


class SuffixProposer:
    """Per running sequence, its context buffer (as the n-gram proposer keeps it); one output cache."""

    def __init__(self, num_speculative_tokens: int, max_tree_depth: int, max_cached_requests: int,
                 max_spec_factor: float, min_token_prob: float) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.max_tree_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.outputs = OutputCache(max_cached_requests)
        self._contexts: dict[str, tuple[np.ndarray, int]] = {}  # id -> (i32[max_num_tokens], tokens in it)

    probes_cheaply = True  # a proposal costs lookups: the scheduler may ask one to learn whether drafts come
    last_round_steady = True  # every proposal costs about the same

    def propose_batch(self, requests: list[Request], max_drafts: list[int]) -> list[list[int]]:
        """Each request's drafts (`propose`)."""
        return [self.propose(request, limit) for request, limit in zip(requests, max_drafts, strict=True)]

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_drafts) drafts to follow the request's known tokens."""
        max_drafts = min(max_drafts, self.num_speculative_tokens)
        context = self._context(request)
        if max_drafts < 1 or context.shape[0] < 2:
            return []
        pattern = context[-self.max_tree_depth :]
        ends = np.flatnonzero(context[:-1] == context[-1])  # i64[C]: earlier places the match could end
        own, own_expected = follow_longest_match(context, ends, pattern, self.max_spec_factor,
                                                 self.min_token_prob, max_drafts)
        if request.cache_salt is not None:
            return own
        cached, cached_expected = self.outputs.propose(pattern, self.max_spec_factor, self.min_token_prob,
                                                       max_drafts)
        return cached if cached_expected > own_expected else own

    def finish(self, request: Request) -> None:
        """Drops a sequence's buffer, and caches its output (a salted request's is not shared)."""
        self._contexts.pop(request.request_id, None)
        if request.cache_salt is None and request.num_tokens > request.num_prompt_tokens:
            self.outputs.add(np.asarray(request.token_ids(request.num_prompt_tokens, request.num_tokens), np.int32))

    def _context(self, request: Request) -> np.ndarray:
        """The request's tokens (i32[L]), its buffer grown by those added since the last proposal."""
        buffer, filled = self._contexts.get(request.request_id) or (np.empty(request.max_num_tokens, np.int32), 0)
        num_tokens = request.num_tokens
        if num_tokens > filled:
            buffer[filled:num_tokens] = request.token_ids(filled, num_tokens)
            self._contexts[request.request_id] = (buffer, num_tokens)
        return buffer[:num_tokens]
