"""Data parallelism on one host: several engine cores, each in its own process on its own devices, behind
one frontend (vLLM's --data-parallel-size).

Processes and threads:
- Each rank is a `CoreProcessClient`'s process (see `core_process`), placed on its GPUs or CPU cores
  (`placement`) before its jax starts. The ranks share nothing but the host and the persistent compilation
  cache.
- Start-up: ranks on GPUs share the host's cores, so with the compilation cache on, rank 0 starts first,
  warms up fully, and the others start once it is ready: they read its compiled steps from the cache
  instead of compiling them again on the same cores at the same time. Ranks pinned to their own CPU
  cores, or without a cache, all start at once. A rank that fails to start stops them all at once.
- `DataParallelClient` is the frontend's `EngineCoreClient`, driven from the engine's one thread, as one
  core's client is. A request's sequences all go to one rank (`SequenceRouter`: the one likely to hold its
  prompt's start in its prefix cache, unless it runs far more than the least loaded); a finish goes to the
  rank that holds the sequence; an adapter goes to every rank. `step()` waits on every rank's pipe at once
  and returns what any has sent.
- A rank that fails ends the engine, as one core's failure does: its requests cannot be vouched for.
"""

import contextlib
import dataclasses
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from multiprocessing.connection import wait

from jaxserve.config import EngineConfig
from jaxserve.engine.core_io import CoreOutputs, EngineInfo, EngineStats
from jaxserve.engine.core_process import STEP_WAIT_S, CoreProcessClient
from jaxserve.engine.kv_cache_manager import extend_page_keys
from jaxserve.engine.placement import placements
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.structured_output import CompiledGrammar
from jaxserve.models.peft import LoraAdapter

logger = logging.getLogger(__name__)


class DataParallelClient:
    def __init__(self, config: EngineConfig, warmup: bool = True) -> None:
        num_ranks = config.parallel.data_parallel_size
        ranks = placements(num_ranks, config.parallel.tensor_parallel_size)
        self.clients: list[CoreProcessClient] = []
        try:
            # Ranks that share the host's cores (GPU ranks): rank 0 warms up fully, filling the cache, and the
            # others start once it is ready and read every step from the cache.
            staggered = config.compilation_cache_dir is not None and ranks[0].cpus is None
            first = dataclasses.replace(config, warmup_mode="full") if staggered and warmup else config
            self.clients.append(CoreProcessClient(first, warmup, ranks[0], wait=False))
            if staggered:
                self._wait_ready()
            self.clients += [CoreProcessClient(config, warmup, rank, wait=False) for rank in ranks[1:]]
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.info: EngineInfo = combined_info([client.info for client in self.clients])
        self.tokenizer = self.clients[0].tokenizer
        self.warmup_seconds = max(client.warmup_seconds for client in self.clients)
        # A request may go past the least loaded rank to one that holds its prefix, by up to an eighth of a
        # rank's sequences (at least one).
        capacity = min(client.info.num_kv_pages for client in self.clients) if self.info.enable_prefix_caching else 0
        self.router = SequenceRouter(num_ranks, slack=max(1, self.info.max_num_seqs // 8), capacity=capacity)
        logger.info("data parallel: %d engine cores, ready %s s after their start; %s", num_ranks,
                    ", ".join(f"{client.ready_at - client.started_at:.1f}" for client in self.clients),
                    "; ".join(f"rank {rank.rank}: {rank.describe()}" for rank in ranks))

    def add_sequences(self, sequences: list[Request], grammar: CompiledGrammar | None = None) -> None:
        first, page_keys = sequences[0], []
        if self.router.capacity:  # prefix caching is on
            page_keys = extend_page_keys([], len(first.prompt_token_ids) // self.info.page_size, self.info.page_size,
                                         lambda start, end: first.prompt_token_ids[start:end], first.prefix_cache_salt)
        rank = self.router.route([sequence.request_id for sequence in sequences], page_keys)
        self.clients[rank].add_sequences(sequences, grammar)

    def finish(self, seq_ids: list[str], status: RequestStatus) -> None:
        by_rank: dict[int, list[str]] = {}
        for seq_id in seq_ids:
            if (rank := self.router.forget(seq_id)) is not None:
                by_rank.setdefault(rank, []).append(seq_id)
        for rank, ids in by_rank.items():
            self.clients[rank].finish(ids, status)

    def add_lora(self, lora_id: int, adapter: LoraAdapter) -> None:
        for client in self.clients:
            client.add_lora(lora_id, adapter)

    def remove_lora(self, lora_id: int) -> None:
        for client in self.clients:
            client.remove_lora(lora_id)

    def start_profile(self, log_dir: str) -> None:
        """Each rank's trace in a folder of its own (`rank0`, `rank1`, ...): their file names would collide."""
        started = []
        try:
            for rank, client in enumerate(self.clients):
                client.start_profile(os.path.join(log_dir, f"rank{rank}"))
                started.append(client)
        except BaseException:  # a rank gone or refusing: those started stop, so none is left tracing
            for client in started:
                with contextlib.suppress(Exception):  # the first failure is the one to report
                    client.stop_profile()
            raise

    def stop_profile(self) -> None:
        for client in self.clients:
            client.stop_profile()

    def step(self) -> list[CoreOutputs]:
        """What every rank has sent since the last call, waiting up to a few milliseconds for any."""
        if not any(client.has_updates for client in self.clients):
            wait([client.connection for client in self.clients], STEP_WAIT_S)
        updates = []
        for client in self.clients:
            for update in client.step(timeout=0):
                for index, detail in update.details.items():
                    if detail.status is not None:  # the core ended it
                        self.router.forget(update.seq_ids[index])
                for failure in update.failures:
                    self.router.forget(failure.seq_id)
                updates.append(update)
        return updates

    def stats(self) -> EngineStats:
        return combined_stats([client.stats() for client in self.clients],
                              [client.info.num_kv_pages for client in self.clients])

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops every rank: all are told first, then each is waited for within the one `timeout`."""
        for client in self.clients:
            client.stop()
        deadline = time.monotonic() + timeout
        for client in self.clients:
            client.shutdown(max(0.0, deadline - time.monotonic()))

    def _wait_ready(self) -> None:
        """Waits until every rank started so far is ready; raises as soon as one fails."""
        while waiting := {client.connection: client for client in self.clients if not client.ready}:
            for connection in wait(list(waiting)):
                waiting[connection].wait_ready()  # a ready message, or CoreProcessDied with the rank's reason


class SequenceRouter:
    """Which rank holds each unfinished sequence, and where a new request goes.

    A request's sequences go together to one rank (n > 1 shares its prompt's pages): the least loaded, ties
    in turn (an idle engine's requests spread over the ranks), unless a rank within `slack` unfinished
    sequences of it likely holds at least half of the prompt's pages more than it does, in which case the
    one that holds the most. A turn of a conversation so finds its history's pages where the last turn left
    them, while a start most prompts share (a chat template's header, a short system prompt) does not pull
    every request to the rank that saw it first, and no rank runs far more than the others. What a rank's
    cache holds is guessed from the page keys of the prompts sent to it, the most recent `capacity` of them
    (a rank cannot hold more pages than its KV cache has); `capacity` 0: by load alone (no prefix caching).
    """

    def __init__(self, num_ranks: int, slack: int = 0, capacity: int = 0) -> None:
        self.loads = [0] * num_ranks  # unfinished sequences per rank
        self.routed = [0] * num_ranks  # sequences sent to each rank since start
        self.slack = slack
        self.capacity = capacity
        self._rank_of: dict[str, int] = {}  # unfinished sequence id -> its rank
        self._next = 0  # the rank a tie goes to first
        self._pages: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_ranks)]  # least recent first

    def route(self, seq_ids: list[str], page_keys: Sequence[bytes] = ()) -> int:
        """The rank that takes one request's sequences `seq_ids`; `page_keys`: its prompt's full pages' keys
        (`kv_cache_manager.extend_page_keys`)."""
        num_ranks = len(self.loads)
        by_load = sorted(range(num_ranks), key=lambda r: (self.loads[r], (r - self._next) % num_ranks))
        rank = least = by_load[0]
        if self.capacity and page_keys:
            longest = self._matched(least, page_keys) + max(1, (len(page_keys) + 1) // 2) - 1
            for candidate in by_load[1:]:
                if self.loads[candidate] > self.loads[least] + self.slack:
                    break
                if (matched := self._matched(candidate, page_keys)) > longest:
                    rank, longest = candidate, matched
            self._remember(rank, page_keys)
        self._next = (rank + 1) % num_ranks
        for seq_id in seq_ids:
            self._rank_of[seq_id] = rank
        self.loads[rank] += len(seq_ids)
        self.routed[rank] += len(seq_ids)
        return rank

    def forget(self, seq_id: str) -> int | None:
        """A sequence ended: its rank, or None if it had ended already."""
        rank = self._rank_of.pop(seq_id, None)
        if rank is not None:
            self.loads[rank] -= 1
        return rank

    def _matched(self, rank: int, page_keys: Sequence[bytes]) -> int:
        """How many of the prompt's first pages the rank was sent last (keys chain: a page's key names its
        whole prefix)."""
        pages = self._pages[rank]
        lo, hi = 0, len(page_keys)  # the first `lo` are there; binary search, as the keys are chained
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if page_keys[mid - 1] in pages:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _remember(self, rank: int, page_keys: Sequence[bytes]) -> None:
        pages = self._pages[rank]
        for key in reversed(page_keys):  # the prompt's last page first out, as a prefix cache evicts
            pages[key] = None
            pages.move_to_end(key)
        while len(pages) > self.capacity:
            pages.popitem(last=False)


def combined_info(infos: Sequence[EngineInfo]) -> EngineInfo:
    """The facts the frontend checks requests against: the rank with the least KV capacity (every rank loads
    the same model with the same config; free device memory may differ), so any request it accepts fits on
    any rank."""
    return min(infos, key=lambda info: info.limits.kv_capacity_tokens)


def combined_stats(stats: Sequence[EngineStats], num_kv_pages: Sequence[int]) -> EngineStats:
    """One snapshot of all ranks, each rank's own kept in `ranks`: counts summed, the KV cache's usage over all
    pages, the adapters of all."""

    def total(name: str) -> int:
        return sum(getattr(item, name) for item in stats)

    def columns(name: str) -> tuple[int, ...]:
        rows = [getattr(item, name) for item in stats if getattr(item, name)]
        return tuple(map(sum, zip(*rows, strict=True))) if rows else ()

    def union(name: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(adapter for item in stats for adapter in getattr(item, name)))

    pages = sum(num_kv_pages)
    return EngineStats(
        num_running=total("num_running"),
        num_waiting=total("num_waiting"),
        kv_cache_usage=sum(item.kv_cache_usage * n for item, n in zip(stats, num_kv_pages, strict=True)) / pages
        if pages else 0.0,
        num_preemptions=total("num_preemptions"),
        prefix_cache_queries=total("prefix_cache_queries"),
        prefix_cache_hits=total("prefix_cache_hits"),
        iteration_tokens_buckets=columns("iteration_tokens_buckets"),
        iteration_tokens_sum=total("iteration_tokens_sum"),
        spec_decode_num_drafts=total("spec_decode_num_drafts"),
        spec_decode_num_draft_tokens=total("spec_decode_num_draft_tokens"),
        spec_decode_num_accepted_tokens=total("spec_decode_num_accepted_tokens"),
        spec_decode_accepted_per_position=columns("spec_decode_accepted_per_position"),
        max_loras=max(item.max_loras for item in stats),
        running_lora_adapters=union("running_lora_adapters"),
        waiting_lora_adapters=union("waiting_lora_adapters"),
        ranks=tuple(stats),
    )
