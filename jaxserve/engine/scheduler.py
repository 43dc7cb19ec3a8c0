"""Continuous batching with chunked prefill (pure Python, no jax).

There are no prefill and decode phases. Every step, each request advances `num_computed_tokens` by as
many tokens as the budget allows: running requests first (a decode costs one token), then waiting
requests in arrival order (a long prompt is split into chunks over several steps). When pages run out,
the newest running request is preempted: its pages are freed and it is recomputed later.

Priority scheduling (`policy="priority"`, vLLM's): the waiting queue and the running list are ordered by
(priority, arrival), lower first, so "newest" above reads "lowest priority, then newest". A waiting
request of higher priority than a running one also preempts it when the waiting one's first chunk
finds no pages or no free sequence slot; requests of one priority never preempt each other for a place.

Prefix caching: a waiting request (new or preempted) starts after the longest run of its full pages
found in the cache, capped so that at least its last token is computed (the step must produce logits).
Pages are keyed only after the step that computed them has run (`update`), so a failed step can never
leave a key on a page that holds nothing. A waiting request whose next page is being computed in this
very step (`n > 1` siblings, or users sharing a system prompt who arrive together) waits one step and
then hits it, rather than computing it a second time.

For metrics, the scheduler stamps each request's first scheduling and tokens, counts preemptions and
keeps a histogram of tokens per step; the engine thread publishes them in its stats snapshot.

Async scheduling: the engine may schedule step N + 1 before it has read step N's sampled tokens. A
request's computed tokens advance when they are scheduled, and a sample not yet read is "in flight": the
next step's decode feeds it by reference (`PENDING_TOKEN` in `token_ids`; the runner takes it from the
previous step's output on the device). A request whose in-flight token is its last allowed one is not
scheduled again; any other stop (EOS, a stop id or string) is seen one step late, and the extra token
that step sampled is dropped, as vLLM's async scheduling does. Pages filled by steps in flight count as
being filled until their step is read, so a request arriving meanwhile still waits for them.

Multi-step decoding (`num_scheduler_steps` k > 1): when nothing waits and every running request decodes on
the device (no grammar, no bans, no top logprobs; penalties, logit_bias and allowed tokens are the row's own
there, `Request.decodes_on_device`), with no sample in flight or, with
`overlap_decode_steps` (async scheduling), the last call's samples in flight (each row's first input is then
pending, as a single step's is), a step plans k decode steps per request in one call (`decode_steps`;
fewer for a request k tokens from its limit, counting the tokens in flight), with pages for all of them.
The runner feeds each sample to the next step on the device; stops are applied when the k tokens are read
(`update_steps`), so a finished request wastes at most k - 1 tokens, or 2k - 1 when calls overlap. A
request preempted while a k-step call for it is in flight resumes once that call is read.

Speculative decoding (`proposer`: vLLM's "ngram" method, `NgramProposer`, or its "draft_model",
`DraftModelProposer`): under the same conditions (a draft row's penalties count the drafts before it, and the
accepted drafts are counted on the device: `runner/penalties.py`), each running request with drafts d1..dm
gets m + 1 consecutive decode rows in one step,
row i feeding its last known token (i = 0) or d_i at the next position (batch expansion: each row attends over
the pages the rows before it wrote this step). Each row samples as a plain decode would, with its own output
index, and `update_verified` keeps row 0's sample, then row i's while row i - 1's sample is d_i. With drafts
that are single tokens rather than distributions, that is exact rejection sampling: a sample equal to the
draft accepts it, and any other sample is the correction, so what a request receives, seeded or greedy, is
token for token what plain decodes give it. Rejected rows' K/V lies past the request's computed tokens and is
overwritten by later steps. How many drafts a step runs is `DraftPolicy`'s choice: the bucket of rows with the
most expected tokens per second, from the measured step times and the recent acceptance. When it runs none (or
no request has a draft), drafting pauses for a few steps, which then schedule asynchronously as without drafts
(a step that may draft needs its requests' last tokens read first): 1 step, then twice as many after each plan
in a row that ran no draft, up to `DRAFT_PAUSE_STEPS`. A pause ends early when a request starts, or, when no
request had a draft, once one's context (up to its token in flight) ends in an n-gram seen before: output that
alternates copied and new text drafts again as soon as it copies, and free text pays a read once per 16 steps
(n-gram lookups only: a draft model is not run just to ask). The proposal's own time counts against the rows
it fills (`DraftPolicy.observe_proposal`): a draft model's two calls a round are not free.
"""

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from jaxserve.engine.draft_policy import DraftPolicy
from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.lora_slots import LoraSlots
from jaxserve.engine.proposer import Proposer
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.step_io import NO_LORA_SLOT, PENDING_TOKEN, NewRequest, SchedulerOutput, StepOutput
from jaxserve.sampling_params import fits_kv_cache, kv_tokens


@dataclass(slots=True)
class _Plan:
    """A step's plan as it is built: `SchedulerOutput`'s columns and sparse maps."""

    request_ids: list[str] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    start_positions: list[int] = field(default_factory=list)
    output_indices: list[int] = field(default_factory=list)
    keeps_sample: list[bool] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    new_pages: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    banned_token_ids: dict[int, tuple[int, ...]] = field(default_factory=dict)
    prompt_logprob_targets: dict[int, tuple[int, ...]] = field(default_factory=dict)
    rows_completing_pages: list[int] = field(default_factory=list)
    grammar_rows: list[int] = field(default_factory=list)
    filling: set[bytes] = field(default_factory=set)  # keys of the full pages this step fills
    decode_steps: list[int] = field(default_factory=list)  # a multi-step decode's steps per row
    draft_lengths: list[int] = field(default_factory=list)  # a speculative decode's drafts per request


# Drafting plans between two plain steps timed for the draft policy (the bucket that holds the running
# requests alone is otherwise not run while every plan drafts, and its cost would go stale).
RETIME_PLANS = 64

# The longest pause of drafting (steps that overlap the host and the device again, as async scheduling
# does) after plans in a row where no draft ran.
DRAFT_PAUSE_STEPS = 16
# Plans in a row where a draft model's drafts could not pay (`DraftPolicy.can_pay`) before they are weighed
# again on fresh measurements: up to REPROBE_ROUNDS rounds, until one is steady (its time counted).
REPROBE_PLANS = RETIME_PLANS * DRAFT_PAUSE_STEPS
REPROBE_ROUNDS = 3

# vLLM's buckets for vllm:iteration_tokens_total.
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class IterationTokens:
    """A histogram of tokens computed per step, kept by the engine thread.

    Plain counts rather than a prometheus Histogram so the scheduler stays free of the server's
    libraries and the hot loop pays one bisect per step; the API reads a copied snapshot.
    """

    def __init__(self) -> None:
        self.bucket_counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)  # per bucket, not cumulative; last: +Inf
        self.sum = 0

    def observe(self, num_tokens: int) -> None:
        self.bucket_counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
        self.sum += num_tokens


class SpeculationCounts:
    """Speculative decoding's counts since start (vLLM's spec_decode metrics), kept by the engine thread:
    requests' drafts verified, draft tokens, accepted ones, and accepted ones per draft position."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts:
            self.num_drafts += 1
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += num_accepted
            for position in range(num_accepted):
                self.accepted_per_position[position] += 1


def _priority_order(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_scheduler_steps: int = 1,
        policy: str = "fcfs",
        proposer: Proposer | None = None,
        row_buckets: tuple[int, ...] = (),
        max_loras: int = 0,
        overlap_decode_steps: bool = False,
        disable_by_batch_size: int | None = None,
        whole_prompts: bool = False,
    ) -> None:
        """`proposer`: speculative decoding's drafts, run on the decode buckets `row_buckets` (the runner's
        request buckets) as `DraftPolicy` chooses. `max_loras`: the device's LoRA slots (--enable-lora): the
        running requests use at most that many adapters, and a waiting request of another adapter waits at
        the queue's head until a slot frees (vLLM lets later requests pass it; here none starves).
        `overlap_decode_steps` (async scheduling): a k-step decode may be planned while the last step's
        samples are still in flight, its first tokens taken from them on the device; never with a proposer
        (drafting plans need the tokens, and its draft policy times k-step calls read at once).
        `disable_by_batch_size` (vLLM's): no drafts while more requests than this run.
        `whole_prompts` (an encoder's, which reads a prompt both ways): a prompt is never split over steps; one
        that the step's budget left cannot take waits at the queue's head for the next step (the engine keeps
        max_num_batched_tokens at least the longest prompt)."""
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.kv_cache = kv_cache
        self.by_priority = policy == "priority"
        self.num_scheduler_steps = num_scheduler_steps
        self.overlap_decode_steps = overlap_decode_steps and proposer is None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.whole_prompts = whole_prompts
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._inflight_filling: list[frozenset[bytes]] = []  # per scheduled step not yet updated
        self.num_preemptions = 0  # since start (vLLM's num_preemptions_total)
        self.prefix_cache_queries = 0  # tokens of requests looked up in the prefix cache, since start
        self.prefix_cache_hits = 0  # of which found cached
        self.iteration_tokens = IterationTokens()
        self.proposer = proposer
        self.disable_by_batch_size = disable_by_batch_size
        max_rows = min(max_num_seqs, max_num_batched_tokens)
        self.draft_policy = (DraftPolicy(row_buckets or (max_rows,), max_rows, plain_overlaps=overlap_decode_steps)
                             if proposer is not None else None)
        self._first_drafts: dict[str, int] = {}  # id -> the first draft of a request whose drafts did not run
        self._draft_pause = 0  # steps left before drafting may run again
        self._next_draft_pause = 1  # the pause after the next plan that runs no draft
        self._paused_without_drafts = False  # the pause followed a plan where no request had a draft
        self._times_base = False  # the next plan is one plain step, timed for the draft policy
        self._plans_since_timed = 0  # drafting plans since the requests' own bucket was last timed
        self._plans_unpaid = 0  # plans in a row without drafting because a draft model's drafts could not pay
        self._reprobes = 0  # rounds a draft model runs whether or not they could pay (REPROBE_PLANS)
        self.speculation = SpeculationCounts(proposer.num_speculative_tokens if proposer is not None else 0)
        self._caching, self._page_size = kv_cache.enable_prefix_caching, kv_cache.page_size
        self.lora_slots = LoraSlots(max_loras)

    def check_fits(self, request: Request) -> None:
        """Raises ValueError if the request could never fit in the cache, or with `whole_prompts` in a step (the
        frontend refused it already, by the same rules: a guard against a queue that could never move)."""
        if self.whole_prompts and request.num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"a prompt of {request.num_tokens} tokens is read whole in one step, which takes "
                             f"{self.max_num_batched_tokens}")
        needed = kv_tokens(request.max_num_tokens, pooled=request.pooling_type is not None)
        if not fits_kv_cache(needed, self.kv_cache.capacity_tokens):
            raise ValueError(f"request needs up to {needed} tokens of KV cache but the cache holds "
                             f"{self.kv_cache.capacity_tokens}")

    def add_request(self, request: Request) -> None:
        self.check_fits(request)
        self.requests[request.request_id] = request
        if self.by_priority:  # after the requests of its priority that came before it
            bisect.insort_right(self.waiting, request, key=_priority_order)
        else:
            self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def only_decodes(self) -> bool:
        """Whether multi-step or speculative decoding may apply (speculative once no sample is in flight): the
        running requests asked once (`_all_decode`)."""
        return (self.num_scheduler_steps > 1 or self.drafting) and self._all_decode()

    def steps_apply(self) -> bool:
        """k-step decodes may run: k > 1 and every running request decodes on the device (`_all_decode`)."""
        return self.num_scheduler_steps > 1 and self._all_decode()

    def drafts_apply(self) -> bool:
        """Drafts may run: a proposer, not paused, and every running request decodes on the device (each
        draft's row samples as its first row does; `_all_decode`)."""
        return self.drafting and self._all_decode()

    def _all_decode(self) -> bool:
        """Nothing waits, and every running request has its one next token to compute and decodes on the
        device (`Request.decodes_on_device`; a plain decode without a grammar, most rows of a busy step,
        asked inline)."""
        return not self.waiting and bool(self.running) and all(
            ((request.has_plain_decodes and request.grammar is None) or request.decodes_on_device)
            and request.num_tokens + request.num_inflight_tokens - request.num_computed_tokens == 1
            for request in self.running)

    @property
    def drafting(self) -> bool:
        """Speculative decoding is on, not paused, and, for a proposer whose rounds cost (a draft model), its
        drafts could pay were all accepted (`DraftPolicy.can_pay`): where they could not, steps go on
        overlapping as without a proposer, and no round runs."""
        proposer = self.proposer
        return self._may_draft and (
            proposer.probes_cheaply or self._reprobes > 0
            or self.draft_policy.can_pay(len(self.running), proposer.num_speculative_tokens))

    @property
    def _may_draft(self) -> bool:
        """A proposer, no pause, and no more requests running than `disable_by_batch_size`."""
        return self.proposer is not None and not self._draft_pause and self._within_batch_limit

    @property
    def _within_batch_limit(self) -> bool:
        limit = self.disable_by_batch_size
        return limit is None or len(self.running) <= limit

    def schedule(self) -> SchedulerOutput:
        if (self._may_draft and not self.proposer.probes_cheaply
                and self.running and not self.drafting):  # off: the drafts could not pay, on old measurements
            self._plans_unpaid += 1
            if self._plans_unpaid >= REPROBE_PLANS:  # weighed again: rounds, one step apart, until one is steady
                self._plans_unpaid, self._reprobes, self._next_draft_pause = 0, REPROBE_ROUNDS, 1
                self.draft_policy.remeasure_proposals(len(self.running))
        if self._draft_pause:
            self._draft_pause -= 1
            if (self._draft_pause and self._paused_without_drafts and self.proposer.probes_cheaply
                    and self._within_batch_limit and any(
                    self.proposer.propose_batch([request], [1])[0] for request in self.running)):  # copying again
                self._draft_pause = 0
        if self.only_decodes() and (self.overlap_decode_steps
                                    or not any(request.num_inflight_tokens for request in self.running)):
            plan = self._plan_speculative() if self.drafts_apply() else None
            if plan is None and not self._times_base and self.steps_apply():
                plan = self._plan_decode_steps()
            self._times_base = False
            if plan is not None:
                return self._output(plan, [])
        token_budget = self.max_num_batched_tokens
        plan = _Plan()
        preempted: list[str] = []
        busy = frozenset().union(*self._inflight_filling)  # keys of the pages steps in flight fill
        if self.by_priority:
            self.running.sort(key=_priority_order)  # stable: arrival order within a priority
            yielded = self._yield_to_waiting()
        else:
            yielded = []

        # Running requests, oldest (or most urgent) first; preempt from the other end when pages run out.
        page_size, caching = self._page_size, self._caching
        ids, counts, tokens, starts, outputs, keeps = (plan.request_ids, plan.num_new_tokens, plan.token_ids,
                                                       plan.start_positions, plan.output_indices, plan.keeps_sample)
        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_inflight = request.num_inflight_tokens
            num_known = request.num_tokens + num_inflight
            if num_known >= request.max_num_tokens:  # its last token is in flight: it finishes when read
                index += 1
                continue
            start = request.num_computed_tokens
            if (  # a plain decode: one token, its page there and sent, nothing sparse (most rows of a busy step)
                num_known - start == 1 and request.has_plain_decodes and request.grammar is None
                and start < (num_pages := len(request.page_ids)) * page_size
                and request.num_pages_scheduled == num_pages and not (caching and (start + 1) % page_size == 0)
            ):  # `_plan_row`'s row, written inline: the same columns and the same counter moves
                ids.append(request.request_id)
                counts.append(1)
                tokens.append(PENDING_TOKEN if num_inflight else request.last_token_id)
                starts.append(start)
                outputs.append(len(request.output_token_ids) + num_inflight)
                keeps.append(True)
                request.num_computed_tokens = num_known
                request.num_inflight_tokens = num_inflight + 1
                token_budget -= 1
                index += 1
                continue
            end = min(num_known, start + token_budget)
            if end > len(request.page_ids) * page_size:  # it needs a page (a decode does once a page)
                end = self._make_room(request, start, end, num_known - start > 1, preempted)
                if end is None:  # it preempted itself: nothing more fits
                    break
                if end == start:  # a prefill that waits, in its pages, for some to free
                    index += 1
                    continue
            token_budget -= self._plan_row(request, end, plan)
            index += 1

        # Waiting requests, in queue order, while there is room; never skip ahead of the queue, but for the
        # one LoRA rule: once a request's adapter waits for a slot (the running requests hold all --max-loras),
        # base-model requests behind it may start (they hold no slot, so they never delay it), and no other
        # adapter's request may (a running adapter's new requests would keep its slot from freeing).
        now = time.monotonic()
        passed = 0  # LoRA requests left at the queue's head this step
        if not preempted:  # (requests that yielded to the queue's head stand behind it)
            while len(self.waiting) > passed and token_budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[passed]
                if request.num_inflight_tokens or request.request_id in yielded:
                    # It yielded to the queue's head in this schedule (priority policy): it resumes from the
                    # next step on, not in the plan it just left. And while a step that samples it is in
                    # flight (async scheduling, overlapped calls), that step writes its old pages, which
                    # resuming now would key for the prefix cache under new pages never computed.
                    break
                if request.lora_id is not None and (passed or not self.lora_slots.can_take(request.lora_id)):
                    passed += 1
                    continue
                hit = self._cached_prefix(request, plan.filling, busy)
                if hit is None:
                    break  # its next page is computed in this step: it hits that page next step
                if self.whole_prompts and request.num_tokens - len(hit) * self._page_size > token_budget:
                    break  # it starts whole in a step with room for it
                self.kv_cache.take(hit)
                request.page_ids.extend(hit)
                num_cached = len(hit) * self.kv_cache.page_size
                end = min(request.num_tokens, num_cached + token_budget)
                self.kv_cache.release_outside_window(request.page_ids, num_cached)
                if not self.kv_cache.allocate(request.page_ids, end):
                    self.kv_cache.free(request.page_ids)  # give the hit back
                    break
                del self.waiting[passed]
                if request.lora_id is not None:
                    request.lora_slot = self.lora_slots.acquire(request.lora_id)
                request.num_computed_tokens, request.num_keyed_pages = num_cached, len(hit)
                if self.kv_cache.enable_prefix_caching and request.reads_prefix_cache:
                    self.prefix_cache_queries += request.num_tokens
                    self.prefix_cache_hits += num_cached
                request.status = RequestStatus.RUNNING
                self._draft_pause, self._next_draft_pause = 0, 1  # a new context to draft from
                if request.first_scheduled_time is None:  # a preempted request keeps its first stamps
                    request.first_scheduled_time = now
                    request.num_cached_tokens = num_cached
                self.running.append(request)
                token_budget -= self._plan_row(request, end, plan, resumed=True)
        return self._output(plan, yielded + preempted)

    def _make_room(self, request: Request, start: int, end: int, is_chunk: bool, preempted: list[str]) -> int | None:
        """Allocates the pages of `request`'s row [start, end), preempting from the running list's end (the
        least urgent first) until they fit; returns the row's end, or None where the request preempted itself.
        A prefill chunk with only itself left to preempt takes the pages there are instead: a shorter chunk, or
        none this step (`start`: it keeps its pages). Preempting itself would drop what it computed for pages
        that no one takes in this plan (a plan that preempts starts no waiting request), and the next plan would
        start it again into the same pages, step after step while the others run."""
        kv_cache = self.kv_cache
        kv_cache.release_outside_window(request.page_ids, start)
        while not kv_cache.allocate(request.page_ids, end):
            if is_chunk and self.running[-1] is request:
                end = min(end, (len(request.page_ids) + kv_cache.num_free_pages) * self._page_size)
                if end <= start:
                    return start
                continue  # (it fits now)
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return None
        return end

    def _yield_to_waiting(self) -> list[str]:
        """Priority policy: preempts running requests of lower priority than the next waiting request to
        start (`_next_to_start`), the lowest first, as few as its first chunk needs to start in this plan
        (a sequence slot, some of the token budget, its pages past its prefix-cache hit, once the running
        requests that stay have planned their rows); returns their ids. None yields where even all of them
        would not let it start (requests of its priority or above hold the room): they would only recompute,
        later, what they had computed, while it waits all the same."""
        head = self._next_to_start()
        if head is None or head.num_inflight_tokens:  # (a step in flight still writes its old pages)
            return []
        hit = self._cached_prefix(head, set(), frozenset().union(*self._inflight_filling))
        if hit is None:  # it starts next step, after the page a step in flight fills
            return []
        kv_cache, head_order, running = self.kv_cache, _priority_order(head), self.running
        revived = sum(kv_cache.ref_count(page) == 0 for page in hit)  # free cached pages it takes back
        # The budget left and the pages taken once the first m running requests plan their next rows, as
        # the running loop plans them (windows' releases aside), for every m.
        budget, taken, after = self.max_num_batched_tokens, 0, [(self.max_num_batched_tokens, 0)]
        for request in running:
            num_known = request.num_tokens + request.num_inflight_tokens
            if budget > 0 and num_known < request.max_num_tokens:
                end = min(num_known, request.num_computed_tokens + budget)
                budget -= end - request.num_computed_tokens
                taken += max(0, kv_cache.num_pages_for(end) - len(request.page_ids))
            after.append((budget, taken))
        lower = [request for request in reversed(running) if _priority_order(request) > head_order]
        freed = 0
        for count in range(len(lower) + 1):  # the running list's tail yields (it is in priority order)
            if count:
                freed += kv_cache.num_freed_by(lower[count - 1].page_ids)
            budget, taken = after[len(running) - count]
            if len(running) - count >= self.max_num_seqs or budget <= 0:
                continue
            end = min(head.num_tokens, len(hit) * self._page_size + budget)
            if kv_cache.num_free_pages + freed - taken >= kv_cache.num_pages_for(end) - len(hit) + revived:
                break
        else:
            return []
        yielded = []
        for _ in range(count):
            victim = running.pop()
            self._preempt(victim)
            yielded.append(victim.request_id)
        return yielded

    def _next_to_start(self) -> Request | None:
        """The waiting request that the waiting loop would start first: the queue's head, or, while the head's
        adapter waits for a LoRA slot, the first base-model request behind it (the loop's one LoRA rule:
        preempting for the head itself would free sequences and pages, not slots)."""
        for index, request in enumerate(self.waiting):
            if request.lora_id is None or (index == 0 and self.lora_slots.can_take(request.lora_id)):
                return request
        return None

    def _output(self, plan: _Plan, preempted: list[str]) -> SchedulerOutput:
        finished, self._finished_ids = tuple(self._finished_ids), []
        output = SchedulerOutput(
            plan.request_ids, plan.num_new_tokens, plan.token_ids, plan.start_positions, plan.output_indices,
            plan.keeps_sample, tuple(plan.new_requests), plan.new_pages, plan.banned_token_ids,
            plan.prompt_logprob_targets, tuple(plan.rows_completing_pages), tuple(plan.grammar_rows),
            preempted_ids=tuple(preempted), finished_ids=finished, filling_keys=frozenset(plan.filling),
            decode_steps=tuple(plan.decode_steps), draft_lengths=tuple(plan.draft_lengths),
        )
        self._inflight_filling.append(output.filling_keys)
        if not output.is_empty:  # a k-step decode computes each row's token once a step it runs
            self.iteration_tokens.observe(sum(output.decode_steps) if output.is_multi_step else output.num_tokens)
        return output

    def _plan_decode_steps(self) -> _Plan | None:
        """Every running request decodes up to k steps (`only_decodes`; with `overlap_decode_steps` the
        samples of the step in flight feed the first); None when their pages do not all fit without
        preempting (the one-step plan then decides who yields), or when a request's last token is in flight
        (it finishes when read: the one-step plan leaves it out)."""
        if len(self.running) > self.max_num_batched_tokens:
            return None
        k, kv_cache = self.num_scheduler_steps, self.kv_cache
        steps = [min(k, request.max_num_tokens - request.num_tokens - request.num_inflight_tokens)
                 for request in self.running]
        if min(steps) < 1 or max(steps) == 1:  # one step is the plain decode's plan
            return None
        new_pages = sum(max(0, kv_cache.num_pages_for(request.num_computed_tokens + n) - len(request.page_ids))
                        for request, n in zip(self.running, steps, strict=True))
        if new_pages > kv_cache.num_free_pages:
            return None
        plan = _Plan()
        for request, num_steps in zip(self.running, steps, strict=True):
            start = request.num_computed_tokens
            kv_cache.release_outside_window(request.page_ids, start)
            kv_cache.allocate(request.page_ids, start + num_steps)  # fits: counted above
            self._plan_row(request, start + 1, plan, num_steps=num_steps)
            plan.decode_steps.append(num_steps)
        return plan

    def _plan_speculative(self) -> _Plan | None:
        """Every running request decodes, those with drafts on m + 1 rows (`only_decodes`, nothing in flight);
        None when no draft is worth its row (`DraftPolicy`), or when their pages do not all fit without
        preempting. A request's drafts stop one short of its remaining tokens."""
        proposer, kv_cache, running = self.proposer, self.kv_cache, self.running
        self._plans_since_timed += 1
        if not proposer.probes_cheaply and (self._plans_since_timed > RETIME_PLANS
                                            or not self.draft_policy.is_timed(len(running))):
            # A draft model's round runs only where its drafts can run (below) and could pay (`drafting`)
            self._times_base, self._plans_since_timed = True, 0
            return None
        self._plans_unpaid = 0
        proposed_at = time.perf_counter()
        proposals = proposer.propose_batch(running, [request.max_num_tokens - request.num_tokens - 1
                                                     for request in running])
        if proposer.last_round_steady:  # not a round that caught up on prompts or a pause's tokens
            self.draft_policy.observe_proposal(len(running), time.perf_counter() - proposed_at)
            self._reprobes = 0
        else:
            self._reprobes = max(0, self._reprobes - 1)
        kept = self.draft_policy.choose(proposals) if any(proposals) else [0] * len(running)
        if kept is None or self._plans_since_timed > RETIME_PLANS:
            # The requests' own bucket has no step time yet, or an old one: one plain step measures it.
            self._times_base, self._plans_since_timed = True, 0
            return None
        for request, drafts, num_kept in zip(running, proposals, kept, strict=True):
            if drafts and not num_kept:  # checked against the token it samples (`_take_sample`)
                self._first_drafts[request.request_id] = drafts[0]
        if not any(kept):
            self._pause_drafting(had_drafts=any(proposals))
            return None
        self._next_draft_pause = 1
        new_pages = sum(max(0, kv_cache.num_pages_for(request.num_computed_tokens + 1 + num_kept)
                            - len(request.page_ids)) for request, num_kept in zip(running, kept, strict=True))
        if new_pages > kv_cache.num_free_pages:
            return None
        plan = _Plan()
        for request, drafts, num_kept in zip(running, proposals, kept, strict=True):
            start = request.num_computed_tokens
            kv_cache.release_outside_window(request.page_ids, start)
            kv_cache.allocate(request.page_ids, start + 1 + num_kept)  # fits: counted above
            output_index = len(request.output_token_ids)
            self._plan_row(request, start + 1, plan)
            for offset, draft in enumerate(drafts[:num_kept], 1):  # rows that only the verification may keep
                plan.request_ids.append(request.request_id)
                plan.num_new_tokens.append(1)
                plan.token_ids.append(draft)
                plan.start_positions.append(start + offset)
                plan.output_indices.append(output_index + offset)
                plan.keeps_sample.append(True)
            plan.draft_lengths.append(num_kept)
        return plan

    def _pause_drafting(self, had_drafts: bool) -> None:
        """No draft runs in this plan: drafting pauses, for twice as many steps as the last pause in a row (up
        to DRAFT_PAUSE_STEPS). `had_drafts`: some request had drafts (else an n-gram found may end it early)."""
        self._draft_pause, self._paused_without_drafts = self._next_draft_pause, not had_drafts
        self._next_draft_pause = min(2 * self._next_draft_pause, DRAFT_PAUSE_STEPS)

    def _plan_row(self, request: Request, end: int, plan: _Plan, resumed: bool = False, num_steps: int = 1) -> int:
        """Adds the request's tokens up to `end` to the plan as its next row and advances its counters (the
        one place a step moves them forward, but for the plain decodes `schedule` writes inline, the same
        way); returns the number of tokens. `resumed`: it just left the waiting queue (new, preempted, or
        after a prefix-cache hit) and takes a runner row. `num_steps`: a decode's steps in a multi-step
        plan, each computing one more position and sampling one more token."""
        start, num_tokens, num_inflight = request.num_computed_tokens, request.num_tokens, request.num_inflight_tokens
        num_new, row = end - start, len(plan.request_ids)
        keeps_sample = end == num_tokens + num_inflight
        plan.request_ids.append(request.request_id)
        plan.num_new_tokens.append(num_new)
        if end <= num_tokens:
            plan.token_ids += request.token_ids(start, end)
        else:  # the token past the known ones is in flight
            plan.token_ids += request.token_ids(start, num_tokens)
            plan.token_ids.append(PENDING_TOKEN)
        plan.start_positions.append(start)
        plan.output_indices.append(len(request.output_token_ids) + num_inflight)  # the sample's index
        plan.keeps_sample.append(keeps_sample)
        page_ids = request.page_ids
        num_pages = len(page_ids)
        if resumed or num_pages > request.num_pages_scheduled:
            first_new_page = 0 if resumed else request.num_pages_scheduled
            plan.new_pages[row] = (first_new_page, tuple(page_ids[first_new_page:]))
        computed_end = end + num_steps - 1
        if self._caching and computed_end // self._page_size > start // self._page_size:  # it completes a page
            self._plan_page_keys(request, start, computed_end, row, plan)
        if keeps_sample and request.grammar is not None and request.grammar.is_active:  # the core fills its mask
            plan.grammar_rows.append(row)
        if not request.has_plain_decodes:  # what few requests carry
            self._plan_features(request, start, end, row, keeps_sample, plan)
        if resumed:
            params = request.sampling_params
            cached = tuple(request.token_ids(0, start)) if start > 0 and params.has_penalties else None
            plan.new_requests.append(NewRequest.of(request.request_id, params, request.sampling_seed,
                                                   request.num_prompt_tokens, cached, request.lora_id,
                                                   request.lora_slot))
        request.num_computed_tokens = computed_end
        request.num_inflight_tokens = num_inflight + keeps_sample * num_steps
        request.num_pages_scheduled = num_pages
        return num_new

    def _plan_page_keys(self, request: Request, start: int, end: int, row: int, plan: _Plan) -> None:
        """A row that completes a page: keyed for the prefix cache once it has run; its known full pages
        count as being filled meanwhile (a page ending in flight is keyed later)."""
        page_size = self._page_size
        plan.rows_completing_pages.append(row)
        first_page, known_end_page = start // page_size, min(end, request.num_tokens) // page_size
        if known_end_page > first_page:
            plan.filling.update(self._page_keys(request, known_end_page)[first_page:known_end_page])

    @staticmethod
    def _plan_features(request: Request, start: int, end: int, row: int, keeps_sample: bool, plan: _Plan) -> None:
        """min_tokens' and bad words' bans and the prompt tokens to score, for the requests that use them."""
        params = request.sampling_params
        if keeps_sample and (params.min_tokens or params.bad_words) and (banned := request.banned_token_ids()):
            plan.banned_token_ids[row] = banned
        if params.prompt_logprobs is not None and (targets := tuple(request.prompt_token_ids[start + 1 : end + 1])):
            plan.prompt_logprob_targets[row] = targets

    def _cached_prefix(self, request: Request, filling: set[bytes], busy: frozenset[bytes]) -> list[int] | None:
        """The cached pages a waiting request can start after (at most all but its last token), or None
        when the page after them is one that this step or a step in flight fills."""
        if not self.kv_cache.enable_prefix_caching or not request.reads_prefix_cache:
            return []
        num_full = (request.num_tokens - 1) // self.kv_cache.page_size
        keys = self._page_keys(request, num_full)
        hit = self.kv_cache.cached_prefix(keys[:num_full])
        if len(hit) < num_full and (keys[len(hit)] in filling or keys[len(hit)] in busy):
            return None
        return hit

    def _page_keys(self, request: Request, num_full_pages: int) -> list[bytes]:
        return request.full_page_keys(num_full_pages, self.kv_cache.page_size)

    def unschedule(self, scheduler_output: SchedulerOutput) -> None:
        """Takes back a step that never ran (its batch could not be built): its requests keep their pages
        and are planned again from where they were (the one place a step's counters move back). Their new
        pages are sent again (the runner writes pages in place by index, so pages it did record are
        written twice, to the same place)."""
        self._discard_filling(scheduler_output)
        new_pages = scheduler_output.new_pages
        seen: set[str] = set()  # a speculative plan's request has rows for its drafts after its first
        for row, (request_id, start, keeps_sample) in enumerate(zip(
            scheduler_output.request_ids, scheduler_output.start_positions, scheduler_output.keeps_sample,
            strict=True,
        )):
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING or request_id in seen:
                continue
            seen.add(request_id)
            request.num_computed_tokens = start
            request.num_inflight_tokens -= keeps_sample * scheduler_output.steps_of(row)
            if row in new_pages:
                request.num_pages_scheduled = new_pages[row][0]

    def _discard_filling(self, scheduler_output: SchedulerOutput) -> None:
        if scheduler_output.filling_keys in self._inflight_filling:
            self._inflight_filling.remove(scheduler_output.filling_keys)

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request.page_ids)
        self._release_lora_slot(request)
        request.num_computed_tokens = request.num_keyed_pages = request.num_pages_scheduled = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        if self.by_priority:  # before the requests of its priority that came after it
            bisect.insort_left(self.waiting, request, key=_priority_order)
        else:
            self.waiting.appendleft(request)

    def update(self, scheduler_output: SchedulerOutput, step_output: StepOutput) -> list[Request]:
        """Records a step's results (the step's requests, in flight or not, were advanced when scheduled);
        returns the requests that received a new token. A request preempted or finished since the step
        was scheduled keeps the step's real results (its sample, prompt logprobs) but caches no page."""
        num_rows = scheduler_output.num_reqs
        for name in ("sampled_token_ids", "logprobs"):
            if len(getattr(step_output, name)) != num_rows:
                raise ValueError(f"{len(getattr(step_output, name))} {name} for {num_rows} requests")
        self._discard_filling(scheduler_output)
        requests, plan = self.requests, scheduler_output
        self._cache_completed_pages(plan)
        if step_output.pooled:
            self._pool(plan, step_output.pooled)
        for row, (first_token, entries) in step_output.prompt_logprobs.items():
            request = requests.get(scheduler_output.request_ids[row])
            if request is not None and not request.status.is_finished:
                request.add_prompt_logprobs(first_token, entries)
        advanced: list[Request] = []
        top_logprobs, ranks, take_sample = step_output.top_logprobs, step_output.ranks, self._take_sample
        now = time.monotonic()  # one stamp for every token of this step
        samples = zip(plan.request_ids, step_output.sampled_token_ids, step_output.logprobs, strict=True)
        if not top_logprobs and not ranks and all(plan.keeps_sample):  # plain next tokens (most steps)
            for request_id, token_id, logprob in samples:
                request = requests.get(request_id)
                if request is not None and not request.status.is_finished:  # else aborted while the step ran
                    take_sample(request, token_id, logprob, None, None, now, advanced)
            return advanced
        for row, (request_id, token_id, logprob) in enumerate(samples):
            request = requests.get(request_id)
            # A prefill chunk's sample is no real next token.
            if plan.keeps_sample[row] and request is not None and not request.status.is_finished:
                take_sample(request, token_id, logprob, top_logprobs.get(row), ranks.get(row), now, advanced)
        return advanced

    def _pool(self, plan: SchedulerOutput, pooled: dict[int, tuple]) -> None:
        """--runner pooling: each row's hidden states pooled into its request (summed over its chunks for
        "mean", its first chunk's first token for "cls"); a request whose prompt this step completed gets its
        embedding, before its one sample.

        A mean's sum starts over with each chunk at position 0 (a pooled request reads no cached prefix), not
        when the request is preempted: a chunk in flight then is still read, and added, before the request
        starts over, and if it was the prompt's last the request finishes from it."""
        for row, (first, last, total) in pooled.items():
            request = self.requests.get(plan.request_ids[row])
            if request is None or request.pooling_type is None or request.status.is_finished:
                continue
            if request.pooling_type == "mean":
                starts_over = plan.start_positions[row] == 0 or request.pooled_sum is None
                request.pooled_sum = total if starts_over else request.pooled_sum + total
            elif request.pooling_type == "cls" and plan.start_positions[row] == 0:
                request.pooled_first = first
            if plan.keeps_sample[row]:
                if request.pooling_type == "last":
                    vector = last
                elif request.pooling_type == "cls":
                    vector = request.pooled_first
                else:
                    vector = request.pooled_sum / request.num_prompt_tokens
                request.embedding = vector.tolist()

    def update_steps(self, scheduler_output: SchedulerOutput, step_outputs: list[StepOutput]) -> list[list[Request]]:
        """Records a multi-step decode's results, one `StepOutput` per step: each request takes its samples in
        order until its steps end or a sample finishes it (the rest are dropped); returns, per step, the
        requests that received a token in it."""
        plan = scheduler_output
        if len(step_outputs) != plan.num_steps:
            raise ValueError(f"{len(step_outputs)} step outputs for a plan of {plan.num_steps} steps")
        self._discard_filling(plan)
        requests, take_sample = self.requests, self._take_sample
        now = time.monotonic()  # the steps' tokens are read together
        rows = [(requests.get(request_id), num_steps)
                for request_id, num_steps in zip(plan.request_ids, plan.decode_steps, strict=True)]
        per_step: list[list[Request]] = []
        for step, output in enumerate(step_outputs):
            if len(output.sampled_token_ids) != plan.num_reqs:
                raise ValueError(f"{len(output.sampled_token_ids)} sampled tokens for {plan.num_reqs} requests")
            advanced: list[Request] = []
            for row, ((request, num_steps), token_id, logprob) in enumerate(
                    zip(rows, output.sampled_token_ids, output.logprobs, strict=True)):
                if step < num_steps and request is not None and not request.status.is_finished:
                    take_sample(request, token_id, logprob, None, output.ranks.get(row), now, advanced)
            per_step.append(advanced)
        self._cache_completed_pages(plan)  # after the samples: the pages' keys hold them
        return per_step

    def update_verified(self, scheduler_output: SchedulerOutput, step_output: StepOutput) -> list[list[Request]]:
        """Records a speculative decode's samples: each request takes its first row's sample, then row i's
        while the draft row i fed equals the sample before it and the request has not finished; each accepted
        draft's K/V becomes computed. Returns, per position, the requests that received a token at it."""
        plan = scheduler_output
        if len(step_output.sampled_token_ids) != plan.num_reqs:
            raise ValueError(f"{len(step_output.sampled_token_ids)} sampled tokens for {plan.num_reqs} rows")
        self._discard_filling(plan)
        samples, logprobs, ranks = step_output.sampled_token_ids, step_output.logprobs, step_output.ranks
        inputs = plan.token_ids
        per_position: list[list[Request]] = [[] for _ in range(max(plan.draft_lengths) + 1)]
        take_sample, counts = self._take_sample, self.speculation
        now = time.monotonic()
        row = 0
        for num_drafts in plan.draft_lengths:
            request = self.requests.get(plan.request_ids[row])
            if request is not None and not request.status.is_finished:  # else aborted while the step ran
                accepted = 0  # counted as vLLM counts them, a stop inside the run aside
                while accepted < num_drafts and samples[row + accepted] == inputs[row + accepted + 1]:
                    accepted += 1
                counts.observe(num_drafts, accepted)
                self.draft_policy.observe_verification(num_drafts, accepted)
                take_sample(request, samples[row], logprobs[row], None, ranks.get(row), now, per_position[0])
                for position in range(1, accepted + 1):
                    if request.status.is_finished:  # a stop inside the run: the rest is dropped
                        break
                    request.num_computed_tokens += 1  # the accepted draft's K/V, written by its row
                    request.num_inflight_tokens += 1
                    take_sample(request, samples[row + position], logprobs[row + position], None,
                                ranks.get(row + position), now, per_position[position])
                if self._caching and request.status is RequestStatus.RUNNING:
                    num_full = request.num_computed_tokens // self._page_size
                    if num_full > request.num_keyed_pages:
                        self._cache_pages(request, num_full)
            row += num_drafts + 1
        return per_position

    def _cache_completed_pages(self, plan: SchedulerOutput) -> None:
        """Offers the pages a step completed to the prefix cache, for requests still running (a finished
        request's pages are freed; its later steps' K/V may follow a stop)."""
        if not self._caching:
            return
        requests, page_size = self.requests, self._page_size
        for row in plan.rows_completing_pages:
            request = requests.get(plan.request_ids[row])
            if request is not None and request.status is RequestStatus.RUNNING:  # its pages hold the K/V
                computed_end = plan.start_positions[row] + plan.num_new_tokens[row] + plan.steps_of(row) - 1
                num_full = computed_end // page_size
                if num_full > request.num_keyed_pages:
                    self._cache_pages(request, num_full)

    def _take_sample(self, request: Request, token_id: int, logprob: float, top: dict[int, float] | None,
                     rank: int | None, now: float, advanced: list[Request]) -> None:
        """A kept sample read: the request's next token (it may end the request), stamped `now`; `top` and
        `rank` where the request asked for logprobs."""
        request.num_inflight_tokens -= 1
        if self._first_drafts and (draft := self._first_drafts.pop(request.request_id, None)) is not None:
            self.draft_policy.observe_first_draft(draft == token_id)
        request.append_output_token(token_id, logprob, top, rank)
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        advanced.append(request)
        if request.status.is_finished:
            self._remove(request)

    def _cache_pages(self, request: Request, num_full: int) -> None:
        """Offers the request's first `num_full` pages, now full and computed, to the prefix cache."""
        keys = self._page_keys(request, num_full)
        self.kv_cache.cache_pages(request.page_ids, keys, request.num_keyed_pages, num_full)
        request.num_keyed_pages = num_full

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finishes (stop strings) or aborts requests wherever they are; frees their pages at once."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.is_finished:
                continue
            request.status = status
            self._remove(request)
            finished.append(request)
        return finished

    def uses_lora(self, lora_id: int) -> bool:
        """Whether an unfinished request generates with the adapter `lora_id`."""
        return any(request.lora_id == lora_id for request in self.requests.values())

    def _release_lora_slot(self, request: Request) -> None:
        if request.lora_slot != NO_LORA_SLOT:
            self.lora_slots.release(request.lora_slot)
            request.lora_slot = NO_LORA_SLOT

    def _remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request.page_ids)
        self._release_lora_slot(request)
        del self.requests[request.request_id]
        if self.proposer is not None:
            self.proposer.finish(request)
            self._first_drafts.pop(request.request_id, None)
        self._finished_ids.append(request.request_id)
