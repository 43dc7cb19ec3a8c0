"""Data parallelism on one host: several engine cores, each in its own process on its own devices, behind
one frontend (vLLM's --data-parallel-size).

Processes and threads:
- Each rank is a `CoreProcessClient`'s process (see `core_process`), placed on its GPUs or CPU cores
  (`placement`) before its jax starts. The ranks share nothing but the host and the persistent compilation
  cache.
- Start-up: ranks on GPUs share the host's cores, so with the compilation cache on, rank 0 starts first
  and the others once it is ready: they read its compiled steps from the cache instead of compiling them
  again on the same cores at the same time. Ranks pinned to their own CPU cores, or without a cache, all
  start at once.
- `DataParallelClient` is the frontend's `EngineCoreClient`, driven from the engine's one thread, as one
  core's client is. A request's sequences all go to one rank (n > 1 shares its prompt's pages), the one with
  the fewest unfinished sequences, ties in turn; a finish goes to the rank that holds the sequence; an
  adapter goes to every rank. `step()` waits on every rank's pipe at once and returns what any has sent.
- A rank that fails ends the engine, as one core's failure does: its requests cannot be vouched for.
"""

import logging
from collections.abc import Sequence
from multiprocessing.connection import wait

from jaxserve.config import EngineConfig
from jaxserve.engine.core_io import CoreOutputs, EngineInfo, EngineStats
from jaxserve.engine.core_process import STEP_WAIT_S, CoreProcessClient
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
            # Ranks that share the host's cores (GPU ranks): rank 0 fills the cache that the others read.
            staggered = config.compilation_cache_dir is not None and ranks[0].cpus is None
            self.clients.append(CoreProcessClient(config, warmup, ranks[0], wait=staggered))
            self.clients += [CoreProcessClient(config, warmup, rank, wait=False) for rank in ranks[1:]]
            for client in self.clients:
                client.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.info: EngineInfo = combined_info([client.info for client in self.clients])
        self.tokenizer = self.clients[0].tokenizer
        self.warmup_seconds = max(client.warmup_seconds for client in self.clients)
        self.router = SequenceRouter(num_ranks)
        logger.info("data parallel: %d engine cores, ready %s s after their start; %s", num_ranks,
                    ", ".join(f"{client.ready_at - client.started_at:.1f}" for client in self.clients),
                    "; ".join(f"rank {rank.rank}: {rank.describe()}" for rank in ranks))

    def add_sequences(self, sequences: list[Request], grammar: CompiledGrammar | None = None) -> None:
        rank = self.router.route([sequence.request_id for sequence in sequences])
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

    def shutdown(self) -> None:
        for client in self.clients:
            client.shutdown()


class SequenceRouter:
    """Which rank holds each unfinished sequence. A request's sequences go together to the rank with the
    fewest unfinished sequences, ties in turn (so an idle engine's requests spread over the ranks)."""

    def __init__(self, num_ranks: int) -> None:
        self.loads = [0] * num_ranks  # unfinished sequences per rank
        self.routed = [0] * num_ranks  # sequences sent to each rank since start
        self._rank_of: dict[str, int] = {}  # unfinished sequence id -> its rank
        self._next = 0  # the rank a tie goes to first

    def route(self, seq_ids: list[str]) -> int:
        """The rank that takes one request's sequences `seq_ids`."""
        num_ranks = len(self.loads)
        rank = min(range(num_ranks), key=lambda r: (self.loads[r], (r - self._next) % num_ranks))
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


def combined_info(infos: Sequence[EngineInfo]) -> EngineInfo:
    """The facts the frontend checks requests against: the rank with the least KV capacity (every rank loads
    the same model with the same config; free device memory may differ), so any request it accepts fits on
    any rank."""
    return min(infos, key=lambda info: info.limits.kv_capacity_tokens)


def combined_stats(stats: Sequence[EngineStats], num_kv_pages: Sequence[int]) -> EngineStats:
    """One snapshot of all ranks: counts summed, the KV cache's usage over all pages, the adapters of all."""

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
    )
