"""Continuous batching with chunked prefill (pure Python, no jax).

There are no prefill and decode phases. Every step, each request advances `num_computed_tokens` by as
many tokens as the budget allows: running requests first (a decode costs one token), then waiting
requests in arrival order (a long prompt is split into chunks over several steps). When pages run out,
the newest running request is preempted: its pages are freed and it is recomputed later.

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
"""

import bisect
import functools
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from jaxserve.engine.kv_cache_manager import KVCacheManager, extend_page_keys
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.outputs import Logprob
from jaxserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxserve.engine.structured_output import GrammarMatcher


# Stands in `ScheduledRequest.token_ids` and `DecodeColumns.token_ids` for a token sampled by the previous
# step and not yet read.
PENDING_TOKEN = -1


class ScheduledRequest(NamedTuple):
    """One request's share of a step, as plain values fixed when it was scheduled (vLLM's
    `SchedulerOutput` shape): the runner reads these, never the live `Request`, which the engine goes on
    changing. The grammar matcher is the one live object: the runner only reads its next-token mask.
    A NamedTuple: one is built per running request per step, 2.3x faster than a frozen dataclass."""

    request_id: str
    token_ids: tuple[int, ...]  # the tokens to compute this step; the last may be PENDING_TOKEN
    start_position: int  # position of token_ids[0]
    # The request's pages from index first_new_page on, which the runner has not been sent: those this
    # step allocated, or all of them (first_new_page 0) when the request starts or resumes. The runner
    # keeps each running request's page table row (its persistent batch) and writes them in place.
    first_new_page: int
    new_page_ids: tuple[int, ...]
    resumed: bool  # it left the waiting queue for this step (new, preempted, after a prefix-cache hit)
    keeps_sample: bool  # this step computes the request's last known token, so its sample is the next token
    sampling_params: SamplingParams
    sampling_seed: int
    num_prompt_tokens: int
    num_output_tokens: int  # before this step (in flight included): the index of its sample (seeds reproduce)
    banned_token_ids: tuple[int, ...] = ()  # min_tokens: stop and EOS ids this sample may not be
    prompt_logprob_targets: tuple[int, ...] = ()  # the next prompt token of each computed position, to score
    # After a prefix-cache hit with penalties: the cached tokens, which the penalty row counts as if they ran.
    cached_token_ids: tuple[int, ...] | None = None
    grammar: "GrammarMatcher | None" = None  # its mask constrains the sample (only when keeps_sample)


class DecodeColumns(NamedTuple):
    """Plain decodes, as columns: running requests computing one token whose sample is kept, with no page
    to allocate or complete, no pages the runner lacks, and nothing the runner fills row by row
    (`Request.has_plain_decodes`, no grammar). Most of a busy step's requests are these, and a column entry
    costs a few list appends where a `ScheduledRequest` costs a record of fifteen values read by every
    layer (vLLM's `CachedRequestData` does the same for its running requests)."""

    request_ids: list[str]
    token_ids: list[int]  # the token to compute: the last one known, or PENDING_TOKEN when in flight
    positions: list[int]  # its position (its request's start_position)
    output_indices: list[int]  # the index of this step's sample among the request's outputs (seeds reproduce)


NO_DECODES = DecodeColumns([], [], [], [])  # read-only by convention: a step with no plain decodes


@dataclass(frozen=True)
class SchedulerOutput:
    """A step's plan. Its rows, in the batch and in `StepOutput`: the records (`scheduled`), then the plain
    decodes (`decodes`)."""

    scheduled: tuple[ScheduledRequest, ...]
    preempted_ids: tuple[str, ...]
    finished_ids: tuple[str, ...] = ()  # finished or aborted since the last schedule: drop their state
    filling_keys: frozenset[bytes] = frozenset()  # prefix-cache keys of the full pages this step fills
    decodes: DecodeColumns = NO_DECODES

    @functools.cached_property  # read by the scheduler and the runner
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled) + len(self.decodes.request_ids)

    @property
    def num_reqs(self) -> int:
        return len(self.scheduled) + len(self.decodes.request_ids)

    @property
    def request_ids(self) -> list[str]:
        """Every scheduled request's id, in row order."""
        return [s.request_id for s in self.scheduled] + self.decodes.request_ids

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.decodes.request_ids


@dataclass(frozen=True)
class StepOutput:
    """What the runner returns: one sampled token (and its logprob) per scheduled request, in order."""

    request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None] | None = None  # for requests that asked for logprobs
    # For requests computing prompt tokens with prompt logprobs: (first prompt token scored, its entries).
    prompt_logprobs: list[tuple[int, list[dict[int, Logprob]]] | None] | None = None


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


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._inflight_filling: list[frozenset[bytes]] = []  # per scheduled step not yet updated
        self.num_preemptions = 0  # since start (vLLM's num_preemptions_total)
        self.prefix_cache_queries = 0  # tokens of requests looked up in the prefix cache, since start
        self.prefix_cache_hits = 0  # of which found cached
        self.iteration_tokens = IterationTokens()

    def check_fits(self, max_num_tokens: int) -> None:
        """Raises ValueError if a request of up to `max_num_tokens` could never fit in the cache."""
        if self.kv_cache.num_pages_for(max_num_tokens) > self.kv_cache.num_usable_pages:
            raise ValueError(
                f"request needs up to {max_num_tokens} tokens of KV cache but the cache holds "
                f"{self.kv_cache.num_usable_pages * self.kv_cache.page_size}"
            )

    def add_request(self, request: Request) -> None:
        self.check_fits(request.max_num_tokens)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        token_budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        filling: set[bytes] = set()  # keys of the pages this step fills
        busy = frozenset().union(*self._inflight_filling)  # and those steps in flight fill

        # Running requests, oldest first; preempt from the newest end when pages run out.
        decodes = DecodeColumns([], [], [], [])
        decode_ids, decode_tokens, decode_positions, decode_outputs = decodes
        page_size, caching = self.kv_cache.page_size, self.kv_cache.enable_prefix_caching
        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_inflight = request.num_inflight_tokens
            num_known = request.num_tokens + num_inflight
            if num_known >= request.max_num_tokens:  # its last token is in flight: it finishes when read
                index += 1
                continue
            start = request.num_computed_tokens
            if (  # a plain decode (`DecodeColumns`): the page for `start` is there and the runner has it
                num_known - start == 1 and request.has_plain_decodes and request.grammar is None
                and start < (num_pages := len(request.page_ids)) * page_size
                and request.num_pages_scheduled == num_pages and not (caching and (start + 1) % page_size == 0)
            ):
                decode_ids.append(request.request_id)
                decode_tokens.append(PENDING_TOKEN if num_inflight else request.last_token_id)
                decode_positions.append(start)
                decode_outputs.append(len(request.output_token_ids) + num_inflight)
                request.num_computed_tokens = num_known
                request.num_inflight_tokens = num_inflight + 1
                token_budget -= 1
                index += 1
                continue
            num_new = min(num_known - start, token_budget)
            while not self.kv_cache.allocate(request.page_ids, request.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append(self._scheduled(request, num_new, filling))
                token_budget -= num_new
                index += 1
                continue
            break  # the request preempted itself: nothing more fits

        # Waiting requests, in arrival order, while there is room; never skip ahead of the queue.
        now = time.monotonic()
        if not preempted:
            while self.waiting and token_budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                hit = self._cached_prefix(request, filling, busy)
                if hit is None:
                    break  # its next page is computed in this step: it hits that page next step
                self.kv_cache.take(hit)
                request.page_ids.extend(hit)
                num_cached = len(hit) * self.kv_cache.page_size
                num_new = min(request.num_tokens - num_cached, token_budget)
                if not self.kv_cache.allocate(request.page_ids, num_cached + num_new):
                    self.kv_cache.free(request.page_ids)  # give the hit back
                    break
                self.waiting.popleft()
                request.num_computed_tokens, request.num_keyed_pages = num_cached, len(hit)
                if self.kv_cache.enable_prefix_caching and request.reads_prefix_cache:
                    self.prefix_cache_queries += request.num_tokens
                    self.prefix_cache_hits += num_cached
                request.status = RequestStatus.RUNNING
                if request.first_scheduled_time is None:  # a preempted request keeps its first stamps
                    request.first_scheduled_time = now
                    request.num_cached_tokens = num_cached
                self.running.append(request)
                scheduled.append(self._scheduled(request, num_new, filling, resumed=True))
                token_budget -= num_new
        finished, self._finished_ids = tuple(self._finished_ids), []
        output = SchedulerOutput(tuple(scheduled), tuple(preempted), finished, frozenset(filling),
                                 decodes if decode_ids else NO_DECODES)
        self._inflight_filling.append(output.filling_keys)
        if not output.is_empty:
            self.iteration_tokens.observe(output.num_tokens)
        return output

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
        return extend_page_keys(request.page_keys, num_full_pages, self.kv_cache.page_size, request.token_ids,
                                request.cache_salt)

    def _scheduled(
        self, request: Request, num_new: int, filling: set[bytes], resumed: bool = False
    ) -> ScheduledRequest:
        """Advances the request's computed (and in-flight) tokens by this step's share and returns the share.
        `resumed`: the request just left the waiting queue (new, preempted, or after a prefix-cache hit)."""
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        num_tokens = request.num_tokens
        known_end = min(end, num_tokens)  # past it: the token in flight
        if self.kv_cache.enable_prefix_caching:
            first, end_page = start // self.kv_cache.page_size, known_end // self.kv_cache.page_size
            if end_page > first:  # the step completes a page (most decodes do not)
                filling.update(self._page_keys(request, end_page)[first:end_page])
        params = request.sampling_params
        keeps_sample = end == num_tokens + request.num_inflight_tokens
        token_ids = tuple(request.token_ids(start, known_end))
        if end > known_end:
            token_ids += (PENDING_TOKEN,)
        first_new_page = 0 if resumed else request.num_pages_scheduled
        page_ids = request.page_ids
        # Positional: one is built per running request per step, and keywords cost a third more.
        scheduled = ScheduledRequest(
            request.request_id,
            token_ids,
            start,
            first_new_page,
            tuple(page_ids[first_new_page:]) if len(page_ids) > first_new_page else (),
            resumed,
            keeps_sample,
            params,
            request.sampling_seed,
            request.num_prompt_tokens,
            request.num_scheduled_outputs,  # the index of this step's sample
            request.banned_token_ids() if keeps_sample and params.min_tokens else (),  # min_tokens 0 bans nothing
            tuple(request.prompt_token_ids[start + 1 : end + 1]) if params.prompt_logprobs is not None else (),
            tuple(request.token_ids(0, start)) if resumed and start > 0 and params.has_penalties else None,
            request.grammar if keeps_sample else None,
        )
        request.num_computed_tokens = end
        request.num_inflight_tokens += keeps_sample
        request.num_pages_scheduled = len(page_ids)
        return scheduled

    def unschedule(self, scheduler_output: SchedulerOutput) -> None:
        """Takes back a step that never ran (its batch could not be built): its requests keep their pages
        and are planned again from where they were. Their new pages are sent again (the runner writes
        pages in place by index, so pages it did record are written twice, to the same place)."""
        self._discard_filling(scheduler_output)
        for item in scheduler_output.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens = item.start_position
            request.num_inflight_tokens -= item.keeps_sample
            request.num_pages_scheduled = item.first_new_page
        decodes = scheduler_output.decodes
        for request_id, position in zip(decodes.request_ids, decodes.positions, strict=True):
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens = position
            request.num_inflight_tokens -= 1

    def _discard_filling(self, scheduler_output: SchedulerOutput) -> None:
        if scheduler_output.filling_keys in self._inflight_filling:
            self._inflight_filling.remove(scheduler_output.filling_keys)

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request.page_ids)
        request.num_computed_tokens = request.num_keyed_pages = request.num_pages_scheduled = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def update(self, scheduler_output: SchedulerOutput, step_output: StepOutput) -> list[Request]:
        """Records a step's results (the step's requests, in flight or not, were advanced when scheduled);
        returns the requests that received a new token. A request preempted or finished since the step
        was scheduled keeps the step's real results (its sample, prompt logprobs) but caches no page."""
        num_records, num_rows = len(scheduler_output.scheduled), scheduler_output.num_reqs
        for name in ("sampled_token_ids", "logprobs", "top_logprobs", "prompt_logprobs"):
            column = getattr(step_output, name)
            if column is not None and len(column) != num_rows:
                raise ValueError(f"{len(column)} {name} for {num_rows} requests")
        self._discard_filling(scheduler_output)
        advanced: list[Request] = []
        top_logprobs = step_output.top_logprobs or [None] * num_records
        prompt_logprobs = step_output.prompt_logprobs or [None] * num_records
        now = time.monotonic()  # one stamp for every token of this step
        caching, page_size = self.kv_cache.enable_prefix_caching, self.kv_cache.page_size
        for item, token_id, logprob, top, prompt in zip(
            scheduler_output.scheduled, step_output.sampled_token_ids, step_output.logprobs, top_logprobs,
            prompt_logprobs, strict=False,  # the records' rows come first; the decodes' follow
        ):
            request = self.requests.get(item.request_id)
            if request is None or request.status.is_finished:  # aborted while the step ran
                continue
            if caching and request.status is RequestStatus.RUNNING:  # not preempted: its pages hold the K/V
                num_full = (item.start_position + len(item.token_ids)) // page_size
                if num_full > request.num_keyed_pages:  # the step completed a page
                    self._cache_pages(request, num_full)
            if prompt is not None:
                request.add_prompt_logprobs(*prompt)
            if not item.keeps_sample:
                continue  # a prefill chunk: the sample is not a real next token
            self._take_sample(request, token_id, logprob, top, now, advanced)
        # Plain decodes: no page completed, no prompt logprobs, no top logprobs (`DecodeColumns`).
        requests = self.requests
        for request_id, token_id, logprob in zip(
            scheduler_output.decodes.request_ids, step_output.sampled_token_ids[num_records:],
            step_output.logprobs[num_records:], strict=True,
        ):
            request = requests.get(request_id)
            if request is None or request.status.is_finished:  # aborted while the step ran
                continue
            self._take_sample(request, token_id, logprob, None, now, advanced)
        return advanced

    def _take_sample(self, request: Request, token_id: int, logprob: float, top: dict[int, float] | None,
                     now: float, advanced: list[Request]) -> None:
        """A kept sample read: the request's next token (it may end the request), stamped `now`."""
        request.num_inflight_tokens -= 1
        request.append_output_token(token_id, logprob, top)
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

    def _remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request.page_ids)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
