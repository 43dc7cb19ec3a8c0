"""Drafts for speculative decoding from a smaller model (vLLM's "draft_model" method).

The draft model runs on a `ModelRunner` of its own, beside the target's, with a KV cache of its own: as
many pages of its size as the target has of its (`DraftShare`: the target sizes its page count for both),
handed out by a `KVCacheManager` of its own. Nothing the target's scheduler decides (prefix-cache hits,
preemption, which drafts a step verifies) reaches into that cache: each sequence's draft state says how far
its draft K/V is the K/V of the sequence's own tokens, and a round checks that against the tokens the
sequence has now.

The draft's cache caches prefixes as the target's does (where the target's does): a page whose positions
all hold the draft K/V of a sequence's own tokens (those before its last token) is keyed, after the round
that computed it, with the key the target gives the same page (`Request.full_page_keys`: the pages are the
target's size, and keys name tokens, cache salt and adapter). A sequence new to the draft starts after the
longest run of its keys cached; the sequences there go first in a round. A new sequence whose next page
another fills in the same round waits for the next round, as the target's scheduler holds a request back
from a page another fills. So requests on one long prefix hold its draft pages once, as they hold its target
pages once. A keyed page is never written again: a sequence writes only from its valid prefix on, which
never falls back below a page it keyed (`_valid_prefix`).

A round (`propose_batch`, called by the scheduler when every running request decodes) runs, for all the
requests at once:
1. the catch-up: each request's tokens that the draft has not computed (its prompt in the first round, a
   chunk per call where the prompts pass the largest token bucket; then one to a few tokens: the last
   sample and the accepted drafts whose K/V the draft wrote before a rejection), sampling greedily the
   first draft where a request's tokens end;
2. k - 1 decode steps feeding each draft to the next: on GPUs one call that loops on the device
   (`make_decode_steps_fn`), on CPUs a call a step.
Two device calls a round on a GPU (k on a CPU), each read at once: the next call's inputs are its samples. The drafts at
positions n .. n + k - 2 are written to the draft's cache as they are run; a later round keeps those the
sequence then holds (the accepted ones) and recomputes from the first that it does not.

Runs on the engine's thread, like the scheduler that calls it; the runner's warm-up compiles its buckets.
"""

from dataclasses import dataclass, field
from typing import Any

import jax

from jaxserve.config import CacheConfig
from jaxserve.engine.kv_cache_manager import KVCacheManager, shared_window
from jaxserve.engine.request import Request
from jaxserve.engine.step_io import NewRequest, SchedulerOutput
from jaxserve.models.loader import LoadedModel
from jaxserve.parallel import bytes_per_device
from jaxserve.runner.model_runner import DraftShare, ModelRunner, kv_page_bytes
from jaxserve.runner.penalties import PenaltyTables
from jaxserve.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)


def one_call_decodes(platform: str) -> bool:
    """Whether a round's k - 1 decode steps run in one call on `platform` (`DraftModelProposer._decode`)."""
    return platform != "cpu"


def draft_share(draft: LoadedModel, target: LoadedModel, cache_config: CacheConfig, max_num_seqs: int) -> DraftShare:
    """What `draft` takes of the target runner's memory budget (`DraftShare`: its weights, its runner's
    penalty tables, its pages); raises ValueError if it cannot draft for `target`: its tokenizer must be the
    target's (the same token for each id; the two vocabularies may be padded to different sizes)."""
    if not _same_tokens(draft.tokenizer, target.tokenizer):
        raise ValueError("the draft model's tokenizer is not the target's: drafts must be the target's token ids")
    shared = {id(leaf) for leaf in jax.tree.leaves(target.state)}  # an EAGLE or MTP drafter's tables are the target's
    own = [leaf for leaf in jax.tree.leaves(draft.state) if id(leaf) not in shared]
    return DraftShare(bytes_per_device(own),
                      PenaltyTables.num_bytes(max_num_seqs, draft.cfg.vocab_size), kv_page_bytes(draft, cache_config))


def _same_tokens(first: Any, second: Any) -> bool:
    """Whether two tokenizers map the same strings to the same ids."""
    return first is second or (len(first) == len(second) and first.get_vocab() == second.get_vocab())


@dataclass
class _DraftState:
    """A sequence's place in the draft's cache."""

    page_ids: list[int] = field(default_factory=list)
    num_keyed: int = 0  # its leading pages offered to the prefix cache
    num_pages_sent: int = 0  # pages the runner's row holds (sent in plans)
    has_row: bool = False  # the runner holds a row for it
    num_computed: int = 0  # positions whose draft K/V is the sequence's own tokens'
    base: int = 0  # the sequence's tokens when it was last drafted for
    drafts: list[int] = field(default_factory=list)  # the drafts then written at positions base, base + 1, ...


class DraftModelProposer:
    """Proposes each running request's next k tokens, the draft model's greedy continuation."""

    def __init__(self, runner: ModelRunner, num_speculative_tokens: int, vocab_size: int,
                 enable_prefix_caching: bool = True) -> None:
        """`runner`: the draft model's, made with greedy decodes, and `num_decode_steps` k - 1 where the k - 1
        decode steps of a round run in one call (`_decode`); its pages the target's size. `vocab_size`: the
        target's; a draft past it (a padding id of a draft whose vocabulary is padded further) ends the
        request's drafts. `enable_prefix_caching`: the target's setting."""
        self.runner = runner
        self.num_speculative_tokens = num_speculative_tokens
        self.vocab_size = vocab_size
        self.last_round_steady = True  # the last round computed no more than a round's tokens per request
        self.pages = KVCacheManager(runner.num_pages, runner.page_size, enable_prefix_caching,
                                    sliding_window=shared_window(getattr(runner.model.cfg, "sliding_windows", ())))
        self._states: dict[str, _DraftState] = {}
        self._released: list[str] = []  # sequences whose runner rows the next plan releases
        self.num_calls = 0  # device calls, for tests and benchmarks
        self.num_hit_tokens = 0  # positions sequences new to the draft found in its prefix cache

    # Whether the K/V a round's decode steps write for its drafts is the K/V of those tokens once they are
    # accepted (a draft model's); where not (an EAGLE drafter's, computed from its own features), a round
    # computes the accepted drafts again.
    keeps_drafts = True
    # Positions past a round's last draft that its decode steps write to (an EAGLE drafter's next feature)
    lookahead = 0

    def _view(self, request: Request) -> Request:
        """The request as the draft reads it: as it is here (`EagleProposer` shifts it)."""
        return request

    def _before_catch_up(self, rows: list[tuple[Request, _DraftState, int, int]]) -> None:
        """Called before each catch-up call with its rows: (request, state, first position, end position)."""

    # A round runs the draft model: the scheduler does not ask one only to learn whether drafts would come.
    probes_cheaply = False

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        """One request's drafts (`propose_batch` for one)."""
        return self.propose_batch([request], [max_drafts])[0]

    def propose_batch(self, requests: list[Request], max_drafts: list[int]) -> list[list[int]]:
        """Up to min(k, max_drafts[i]) drafts to follow each request's known tokens: `requests` are all the
        running ones (the states of others, preempted since, are dropped), each having its last token to
        compute. A request gets none where the draft's cache or context has no room for its drafts."""
        k = self.num_speculative_tokens
        requests = [self._view(request) for request in requests]
        running = {request.request_id for request in requests}
        for request_id in [key for key in self._states if key not in running]:
            self.forget(request_id)
        proposals: list[list[int]] = [[] for _ in requests]
        eligible: list[tuple[int, Request]] = []
        for index, (request, limit) in enumerate(zip(requests, max_drafts, strict=True)):
            if request.num_tokens + k - 1 + self.lookahead > self.runner.max_model_len:  # past its context, for good
                self.forget(request.request_id)
            elif min(limit, k) >= 1:
                eligible.append((index, request))
        for _, request in eligible:  # first the pages of the states there, for the new ones to find
            if (state := self._states.get(request.request_id)) is not None:
                state.num_computed = _valid_prefix(request, state)
                self._cache_pages(request, state, state.num_computed // self.pages.page_size)
        active: list[tuple[int, Request, _DraftState]] = []
        filling: set[bytes] = set()  # keys of the pages this round's catch-up fills
        # The states there first: the pages they fill this round are `filling` when the new ones look.
        for index, request in sorted(eligible, key=lambda item: item[1].request_id not in self._states):
            state = self._states.get(request.request_id) or self._start(request, filling)
            if state is None:  # its next page is one this round fills: the next round finds it cached
                continue
            self.pages.release_outside_window(state.page_ids, state.num_computed)
            # the drafts' positions too
            if self.pages.allocate(state.page_ids, request.num_tokens + k - 1 + self.lookahead):
                active.append((index, request, state))
                filling.update(self._filled_keys(request, state))
            elif not state.has_row:  # nothing computed yet: a later round looks its prefix up again
                self.forget(request.request_id)
        # A round after a request's start or a pause also computes what the requests made meanwhile: the
        # draft policy times the rounds that do not (`Scheduler._plan_speculative`).
        self.last_round_steady = all(request.num_tokens - state.num_computed <= k + 1 for _, request, state in active)
        if not active:
            return proposals
        try:
            drafts = self._catch_up(active)  # index -> [the first draft]
            if k > 1:
                self._decode(active, drafts)
        except BaseException:  # the states may claim K/V a failed call never wrote
            for _, request, _ in active:
                self.forget(request.request_id)
            raise
        for index, request, state in active:
            # Its tokens' K/V, computed: the pages before its last token are offered now, not a round later
            # (when it may no longer draft), so that those held back find them.
            self._cache_pages(request, state, (request.num_tokens - 1) // self.pages.page_size)
            if self.keeps_drafts:
                state.base, state.drafts = request.num_tokens, drafts[index][: k - 1]
                state.num_computed = request.num_tokens + k - 1
            else:
                state.base, state.drafts, state.num_computed = request.num_tokens, [], request.num_tokens
            kept = drafts[index][: min(max_drafts[index], k)]
            proposals[index] = kept[: next((i for i, token in enumerate(kept) if token >= self.vocab_size),
                                           len(kept))]
        return proposals

    def _start(self, request: Request, filling: set[bytes]) -> _DraftState | None:
        """A sequence new to the draft (or back after a preemption or a failed round): its state after the
        cached pages of the longest run of its keys, at most all but its last token; None (and no state)
        where the page after them is one that this round fills (`filling`), as the target's scheduler holds
        a request back from a page another fills."""
        state = _DraftState()
        if self.pages.enable_prefix_caching:
            num_full = (request.num_tokens - 1) // self.pages.page_size
            keys = request.full_page_keys(num_full, self.pages.page_size)[:num_full]
            hit = self.pages.cached_prefix(keys)
            if len(hit) < num_full and keys[len(hit)] in filling:
                return None
            self.pages.take(hit)
            state.page_ids, state.num_keyed = hit, len(hit)
            state.num_computed = len(hit) * self.pages.page_size
            self.num_hit_tokens += state.num_computed
        self._states[request.request_id] = state
        return state

    def _filled_keys(self, request: Request, state: _DraftState) -> list[bytes]:
        """The keys of the pages that computing the request's tokens from its valid prefix on fills."""
        if not self.pages.enable_prefix_caching:
            return []
        first, end = state.num_computed // self.pages.page_size, request.num_tokens // self.pages.page_size
        return request.full_page_keys(end, self.pages.page_size)[first:end] if end > first else []

    def _cache_pages(self, request: Request, state: _DraftState, num_full: int) -> None:
        """Offers the sequence's first `num_full` pages, which hold its own tokens' K/V, to the prefix cache."""
        if self.pages.enable_prefix_caching and num_full > state.num_keyed:
            keys = request.full_page_keys(num_full, self.pages.page_size)
            self.pages.cache_pages(state.page_ids, keys, state.num_keyed, num_full)
            state.num_keyed = num_full

    def finish(self, request: Request) -> None:
        """A sequence left the scheduler: `forget`."""
        self.forget(request.request_id)

    def forget(self, request_id: str) -> None:
        """Drops a sequence's state and pages (finished, or no longer running)."""
        state = self._states.pop(request_id, None)
        if state is not None:
            self.pages.free(state.page_ids)
            if state.has_row:
                self._released.append(request_id)

    def _catch_up(self, active: list[tuple[int, Request, _DraftState]]) -> dict[int, list[int]]:
        """Computes each request's tokens from its draft state on (in as many calls as the largest bucket
        needs) and samples its first draft where they end."""
        ladder = self.runner.ladder
        max_tokens, max_rows = ladder.token_buckets[-1], ladder.request_buckets[-1]
        firsts: dict[int, list[int]] = {}
        pending = list(active)
        while pending:
            plan = self._new_plan()
            rows: list[tuple[int, int]] = []  # (request index, row) of the rows that end their request's tokens
            spans: list[tuple[Request, _DraftState, int, int]] = []
            left: list[tuple[int, Request, _DraftState]] = []
            for item in pending:
                index, request, state = item
                room = max_tokens - plan.num_tokens
                if room < 1 or plan.num_rows == max_rows:
                    left.append(item)
                    continue
                start, end = state.num_computed, request.num_tokens
                take = min(end - start, room)
                if start + take == end:
                    rows.append((index, plan.num_rows))
                plan.add(request, state, request.token_ids(start, start + take), start, start + take == end)
                spans.append((request, state, start, start + take))
                state.num_computed += take
                if state.num_computed < end:
                    left.append(item)
            self._before_catch_up(spans)
            out = self.runner.collect(self._launch(plan.build()))
            for index, row in rows:
                firsts[index] = [out.sampled_token_ids[row]]
            pending = left
        return firsts

    def _decode(self, active: list[tuple[int, Request, _DraftState]], drafts: dict[int, list[int]]) -> None:
        """Runs k - 1 decode steps from each request's first draft, appending their samples to `drafts`: in
        one multi-step call where the runner has it compiled (GPUs: one launch, no host round trip between
        steps; a background warm-up compiles it last), else a call a step (CPUs, where XLA's loop runs a step at
        a third of a plain step's speed)."""
        steps = self.num_speculative_tokens - 1
        if min(self.runner.num_decode_steps, self.runner.decode_steps_ready()) >= steps > 1:  # one device call
            plan = self._decode_plan(active, drafts, 0).build(decode_steps=steps)
            outputs = self.runner.collect_steps(self._launch(plan))
            for row, (index, _, _) in enumerate(active):
                drafts[index] += [output.sampled_token_ids[row] for output in outputs]
            return
        for step in range(steps):  # a call a step, each fed the last one's samples from the host
            out = self.runner.collect(self._launch(self._decode_plan(active, drafts, step).build()))
            for row, (index, _, _) in enumerate(active):
                drafts[index].append(out.sampled_token_ids[row])

    def _decode_plan(self, active: list[tuple[int, Request, _DraftState]], drafts: dict[int, list[int]],
                     step: int) -> "_PlanBuilder":
        """A decode row per request: its latest draft, at the position after its tokens and `step` drafts."""
        plan = self._new_plan()
        for index, request, state in active:
            plan.add(request, state, drafts[index][-1:], request.num_tokens + step, True)
        return plan

    def _new_plan(self) -> "_PlanBuilder":
        """An empty plan that releases the runner rows of the sequences forgotten since the last one."""
        plan, self._released = _PlanBuilder(self._released), []
        return plan

    def _launch(self, plan: SchedulerOutput):
        self.num_calls += 1
        launched = self.runner.launch(plan)
        assert launched is not None, "a draft plan has rows"
        return launched


def _valid_prefix(request: Request, state: _DraftState) -> int:
    """How many of the request's positions the draft's cache holds its own tokens' K/V for: those before
    the last drafting, then the drafts written that the request now holds; at most all but its last
    token, whose logits the next draft needs."""
    num_tokens = request.num_tokens
    if not state.drafts:
        return min(state.num_computed, num_tokens - 1)
    held = request.token_ids(state.base, min(num_tokens, state.base + len(state.drafts)))
    matched = 0
    while matched < len(held) and held[matched] == state.drafts[matched]:
        matched += 1
    return min(state.base + matched, num_tokens - 1)


class _PlanBuilder:
    """A draft runner's plan, row by row: greedy rows, their pages sent as they grow."""

    def __init__(self, released: list[str]) -> None:
        self.request_ids: list[str] = []
        self._num_new: list[int] = []
        self._token_ids: list[int] = []
        self._starts: list[int] = []
        self._keeps: list[bool] = []
        self._new_requests: list[NewRequest] = []
        self._new_pages: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._released = tuple(released)

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_rows(self) -> int:
        return len(self.request_ids)

    def add(self, request: Request, state: _DraftState, token_ids: list[int], start: int, keeps_sample: bool) -> None:
        row = len(self.request_ids)
        self.request_ids.append(request.request_id)
        self._num_new.append(len(token_ids))
        self._token_ids += token_ids
        self._starts.append(start)
        self._keeps.append(keeps_sample)
        if not state.has_row:
            self._new_requests.append(NewRequest.of(request.request_id, _GREEDY, 0, request.num_prompt_tokens))
            state.has_row, state.num_pages_sent = True, 0
            self._new_pages[row] = (0, tuple(state.page_ids))
        elif len(state.page_ids) > state.num_pages_sent:
            self._new_pages[row] = (state.num_pages_sent, tuple(state.page_ids[state.num_pages_sent:]))
        state.num_pages_sent = len(state.page_ids)

    def build(self, decode_steps: int = 1) -> SchedulerOutput:
        return SchedulerOutput(
            self.request_ids, self._num_new, self._token_ids, self._starts,
            output_indices=[0] * len(self.request_ids), keeps_sample=self._keeps,
            new_requests=tuple(self._new_requests), new_pages=self._new_pages, finished_ids=self._released,
            decode_steps=(decode_steps,) * len(self.request_ids) if decode_steps > 1 else (),
        )
