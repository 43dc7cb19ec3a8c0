"""Drafts for speculative decoding from suffix matches (vLLM's "suffix" method: SuffixDecoding).

Two corpora are searched: the sequence's own context (its prompt and output), and the outputs of recent
finished requests (`OutputCache`, vLLM's global suffix tree). In each, a proposal takes the longest suffix of
the context, at most `max_tree_depth` tokens, that occurs earlier (m tokens long; its occurrences among the
latest MAX_CANDIDATES of the context's last two tokens), and follows those occurrences forward as a walk down
a suffix tree would: at each step the token that most of the still-agreeing occurrences continue with, its
probability the fraction of them that do (those that end count against it), the path's probability the
product of those. The path stops where its probability falls below `min_token_prob`, or after
`max_spec_factor * m` tokens (longer matches earn longer drafts), or at the request's limit. Of the two
corpora's paths, the one with the larger expected number of accepted tokens (the sum of its prefixes'
probabilities) is proposed.

That is what suffix trees of the two corpora give, found without building them (a tree holds a node per
position and depth): each corpus chains every position to the previous one that ends the same token pair, so
a lookup follows the latest occurrences of the context's last pair (at most MAX_CANDIDATES) back through
the corpus, token by token, in plain Python: a few microseconds where numpy's per-call cost would be tens.

A request with a `cache_salt` neither reads nor adds to the output cache (whether drafts are accepted would
tell one tenant of another's outputs); its own context still drafts.

Pure Python, no jax; one thread (the engine's) uses it.
"""

from array import array
from collections import deque
from collections.abc import Sequence

from jaxserve.engine.request import Request

# The output cache's tokens at most, whatever `max_cached_requests` allows (12 bytes a token for the ring and
# its chains, and some 100 more for each distinct token pair the index holds): the oldest outputs leave first.
MAX_CACHED_TOKENS = 1 << 20
# The latest occurrences of the context's last token pair that a lookup follows, at most, in each corpus.
MAX_CANDIDATES = 64
_END = -1  # after each cached output: matches no token, and ends a path
_NONE = -1  # no earlier occurrence


def pair_key(first: int, second: int) -> int:
    """One int for a token pair (token ids are below 2**31)."""
    return (first << 32) | second


def follow_longest_match(corpus: Sequence[int], ends: Sequence[int], pattern: Sequence[int],
                         max_spec_factor: float, min_token_prob: float, max_drafts: int,
                         live: tuple[int, int] | None = None) -> tuple[list[int], float]:
    """The drafts that follow the longest suffix of `pattern` among its occurrences in `corpus` that end at
    `ends` (positions where the corpus holds pattern[-1]), walked as the module docstring says, and the path's
    expected number of accepted tokens. Positions are absolute: position p is corpus[p % len(corpus)], and
    only those in `live`'s [first, end) are read (default: all of the corpus)."""
    if not ends or max_drafts < 1:
        return [], 0.0
    size, depth = len(corpus), len(pattern)
    first, end = live if live is not None else (0, size)
    longest, occurrences = 0, []
    for at in ends:
        length = 1
        while length < depth and at - length >= first and corpus[(at - length) % size] == pattern[-1 - length]:
            length += 1
        if length > longest:
            longest, occurrences = length, [at]
        elif length == longest:
            occurrences.append(at)
    limit = min(max_drafts, int(max_spec_factor * longest))
    nexts = [at + 1 for at in occurrences]  # where each occurrence of the longest match continues
    drafts: list[int] = []
    probability, expected = 1.0, 0.0
    while len(drafts) < limit:
        if len(nexts) == 1:  # one occurrence: its tokens, each a certainty, up to an end
            at = nexts[0]
            while len(drafts) < limit and at < end and (token := corpus[at % size]) != _END:
                drafts.append(token)
                expected += probability
                at += 1
            break
        tokens = [corpus[at % size] if at < end else _END for at in nexts]
        counts: dict[int, int] = {}
        for token in tokens:
            if token != _END:
                counts[token] = counts.get(token, 0) + 1
        if not counts:
            break
        best = min(counts, key=lambda token: (-counts[token], token))  # the most frequent; the smallest id of a tie
        probability *= counts[best] / len(nexts)
        if probability < min_token_prob:
            break
        drafts.append(best)
        expected += probability
        nexts = [at + 1 for at, token in zip(nexts, tokens, strict=True) if token == best]
    return drafts, expected


class PairChains:
    """For a corpus addressed by absolute position, the latest position ending each token pair and, per
    position, the previous one ending the same pair: the occurrences of a pair, latest first, without a list
    per pair. With `ring` slots, they hold the chains of the last `ring` positions (as `OutputCache`'s ring
    holds its tokens); without, the chains grow with the positions, added in order from 1 (a context's)."""

    def __init__(self, ring: int = 0) -> None:
        self.latest: dict[int, int] = {}  # pair_key -> the latest position ending the pair
        self._ring = ring
        self._previous = array("q", [_NONE]) * max(ring, 1)  # [position % slots] -> the previous of its pair

    def add(self, position: int, key: int) -> None:
        if not self._ring:
            self._previous.extend([_NONE] * (position + 1 - len(self._previous)))
        self._previous[position % len(self._previous)] = self.latest.get(key, _NONE)
        self.latest[key] = position

    def occurrences(self, key: int, first: int, skip: int = _NONE) -> list[int]:
        """The latest MAX_CANDIDATES positions from `first` on that end the pair (but `skip`), latest first."""
        found, at, previous = [], self.latest.get(key, _NONE), self._previous
        size, left = len(previous), MAX_CANDIDATES
        while at >= first and left:
            if at != skip:
                found.append(at)
                left -= 1
            at = previous[at % size]
        return found


class OutputCache:
    """The outputs of recent finished requests, up to `max_requests` of them and `max_tokens` tokens, with
    `_END` after each, in a ring of tokens addressed by absolute position (the position of a token ever
    added), each position chained to the previous one of its token pair."""

    def __init__(self, max_requests: int, max_tokens: int = MAX_CACHED_TOKENS) -> None:
        self.max_requests = max_requests
        self._ring = array("i", [_END]) * max_tokens  # the token at absolute position p is at p % max_tokens
        self._chains = PairChains(ring=max_tokens)
        self._total = 0  # tokens ever added (the next absolute position)
        self._starts: deque[int] = deque()  # each cached output's first position, oldest first
        self._sweep: list[int] = []  # pair keys whose latest position the next additions check

    @property
    def num_requests(self) -> int:
        return len(self._starts)

    @property
    def _first_live(self) -> int:
        """The first position still cached: the oldest cached output's start."""
        return self._starts[0] if self._starts else self._total

    def add(self, tokens: Sequence[int]) -> None:
        """Caches one output, evicting the oldest where the requests or the ring overflow."""
        size = len(self._ring)
        tokens = list(tokens[-(size - 1) :])  # an output longer than the ring keeps its end
        if self.max_requests < 1 or not tokens:
            return
        start = self._total
        for offset, token in enumerate([*tokens, _END]):
            self._ring[(start + offset) % size] = token
            if 0 < offset < len(tokens):
                self._chains.add(start + offset, pair_key(tokens[offset - 1], token))
        self._total += len(tokens) + 1
        self._starts.append(start)
        while len(self._starts) > self.max_requests or self._starts[0] < self._total - size:
            self._starts.popleft()
        self._forget_dead_pairs(2 * len(tokens))

    def _forget_dead_pairs(self, budget: int) -> None:
        """Drops up to `budget` pairs whose latest position is no longer cached (each pair is checked once
        per pass over all of them): the index stays about as large as what is cached."""
        first_live, latest = self._first_live, self._chains.latest
        for _ in range(budget):
            if not self._sweep:
                self._sweep = list(latest)
                if not self._sweep:
                    return
            key = self._sweep.pop()
            if latest.get(key, first_live) < first_live:
                del latest[key]

    def propose(self, key: int, pattern: Sequence[int], max_spec_factor: float, min_token_prob: float,
                max_drafts: int) -> tuple[list[int], float]:
        """`follow_longest_match` over the cached outputs, from the latest occurrences of the context's last
        two tokens (`key`)."""
        if not self._starts:
            return [], 0.0
        first_live = self._first_live
        ends = self._chains.occurrences(key, first_live)
        return follow_longest_match(self._ring, ends, pattern, max_spec_factor, min_token_prob, max_drafts,
                                    (first_live, self._total))


class _Context:
    """A running sequence's tokens, as far as the last proposal saw them, with their pair chains."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.chains = PairChains()

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            if self.tokens:
                self.chains.add(len(self.tokens), pair_key(self.tokens[-1], token))
            self.tokens.append(token)


class SuffixProposer:
    """Per running sequence, its context and pair chains; one output cache."""

    def __init__(self, num_speculative_tokens: int, max_tree_depth: int, max_cached_requests: int,
                 max_spec_factor: float, min_token_prob: float) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.max_tree_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.outputs = OutputCache(max_cached_requests)
        self._contexts: dict[str, _Context] = {}

    probes_cheaply = True  # a proposal costs lookups: the scheduler may ask one to learn whether drafts come
    last_round_steady = True  # every proposal costs about the same

    def propose_batch(self, requests: list[Request], max_drafts: list[int]) -> list[list[int]]:
        """Each request's drafts (`propose`)."""
        return [self.propose(request, limit) for request, limit in zip(requests, max_drafts, strict=True)]

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_drafts) drafts to follow the request's known tokens."""
        max_drafts = min(max_drafts, self.num_speculative_tokens)
        context = self._context(request)
        tokens = context.tokens
        if max_drafts < 1 or len(tokens) < 2:
            return []
        pattern, key = tokens[-self.max_tree_depth :], pair_key(tokens[-2], tokens[-1])
        ends = context.chains.occurrences(key, 0, skip=len(tokens) - 1)  # its own end is not an earlier one
        own, own_expected = follow_longest_match(tokens, ends, pattern, self.max_spec_factor, self.min_token_prob,
                                                 max_drafts)
        if request.cache_salt is not None:
            return own
        cached, cached_expected = self.outputs.propose(key, pattern, self.max_spec_factor, self.min_token_prob,
                                                       max_drafts)
        return cached if cached_expected > own_expected else own

    def finish(self, request: Request) -> None:
        """Drops a sequence's context, and caches its output (a salted request's is not shared)."""
        self._contexts.pop(request.request_id, None)
        if request.cache_salt is None and request.num_tokens > request.num_prompt_tokens:
            self.outputs.add(request.token_ids(request.num_prompt_tokens, request.num_tokens))

    def _context(self, request: Request) -> _Context:
        """The request's context, grown by the tokens added since the last proposal."""
        context = self._contexts.get(request.request_id)
        if context is None:
            context = self._contexts[request.request_id] = _Context()
        if request.num_tokens > len(context.tokens):
            context.extend(list(request.token_ids(len(context.tokens), request.num_tokens)))
        return context
