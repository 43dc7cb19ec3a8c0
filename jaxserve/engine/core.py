"""EngineCore: the scheduler, the KV pages and the model runner; sequences in, token updates out.

It knows sequences only (the frontend splits a request with n > 1 into n of them) and token ids: no
text, no `RequestOutput`. `step()` reports every sequence that made progress: plain tokens as columns
(`TokenColumns`), anything more as a `SequenceUpdate`.
The frontend (`LLMEngine`) detokenizes, finds stop strings and tells the core which sequences to finish.
That split is what lets the core run in its own process (`core_process`), where its loop does nothing but
schedule, launch and read steps.

With async scheduling (`SchedulerConfig.async_scheduling`), `step()` schedules and launches step N + 1,
then reads step N's tokens while the device runs N + 1, and reports N's updates: the host's work for a
step overlaps the device's. The updates are the synchronous loop's; a stop is seen one step late, and the
token the extra step sampled is dropped. A sequence with a grammar needs its last token to build its
next mask, so while one is present the loop reads each step before launching the next.
"""

import copy
import logging
import os

import jax

from jaxserve.config import EngineConfig
from jaxserve.engine.core_io import (
    CoreUpdate,
    EngineInfo,
    EngineStats,
    FirstToken,
    SequenceUpdate,
    TokenColumns,
    engine_fault,
)
from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.request import Request, RequestFault, RequestStatus
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.structured_output import CompiledGrammar, GrammarCompiler
from jaxserve.models.loader import LoadedModel, load_model
from jaxserve.runner import multihost
from jaxserve.runner.batch import MAX_BIASED_TOKENS
from jaxserve.runner.buckets import BucketLadder
from jaxserve.runner.model_runner import LaunchedStep, ModelRunner
from jaxserve.sampling_params import InvalidParam, RequestLimits

logger = logging.getLogger(__name__)


def enable_compilation_cache(cache_dir: str | None) -> None:
    if not cache_dir:  # None or "": no persistent cache
        return
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


class EngineCore:
    def __init__(self, config: EngineConfig, model: LoadedModel | None = None, warmup: bool = True) -> None:
        if config.parallel.multihost:
            multihost.initialize(config.parallel)  # before the first jax backend call
        enable_compilation_cache(config.compilation_cache_dir)
        self.config = config
        if model is None:
            model = load_model(
                config.model.model, config.model.dtype, config.attention_impl, config.model.revision,
                config.parallel.tensor_parallel_size, config.model.weight_dtype,
            )
        self.model = model
        self.max_model_len = min(
            config.model.max_model_len or model.max_position_embeddings, model.max_position_embeddings
        )
        sched = config.scheduler
        ladder = BucketLadder(
            config.buckets.token_buckets, config.buckets.request_buckets,
            sched.max_num_batched_tokens, sched.max_num_seqs,
        )
        self.runner = ModelRunner(
            model, config.cache, ladder, self.max_model_len, sched.max_num_seqs, config.model.max_logprobs
        )
        self.kv_cache = KVCacheManager(self.runner.num_pages, config.cache.page_size,
                                       config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_cache, sched.max_num_seqs, sched.max_num_batched_tokens)
        self.async_scheduling = sched.async_scheduling
        self._in_flight: LaunchedStep | None = None  # launched, not read yet (async scheduling)
        # Its own tokenizer copy: grammars compile on other threads (the server's, the core process's).
        self.grammars = GrammarCompiler(copy.deepcopy(model.tokenizer), model.cfg.vocab_size, model.eos_token_ids)
        self.limits = RequestLimits(
            vocab_size=model.cfg.vocab_size,
            max_model_len=self.max_model_len,
            max_logprobs=config.model.max_logprobs,
            max_biased_tokens=MAX_BIASED_TOKENS,
            num_eos_tokens=len(model.eos_token_ids),
            kv_capacity_tokens=self.kv_cache.num_usable_pages * self.kv_cache.page_size,
        )
        source = model.source
        self.info = EngineInfo(
            model_name=model.name,
            model_root=str(source.directory / source.gguf_file if source.gguf_file else source.directory),
            model_dir=None if source.gguf_file else str(source.directory),
            limits=self.limits,
            page_size=self.kv_cache.page_size,
            num_kv_pages=self.kv_cache.num_pages,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            enable_prefix_caching=self.kv_cache.enable_prefix_caching,
            eos_token_ids=tuple(model.eos_token_ids),
            dtype=model.dtype.dtype.name,
            weight_dtype=model.weight_dtype.dtype.name,
        )
        self.warmup_seconds = self.runner.warmup(background=config.background_warmup) if warmup else 0.0
        if config.parallel.multihost and config.parallel.is_leader:  # every process has warmed up alike
            self.runner.leader = multihost.Leader(config.parallel)

    def shutdown(self) -> None:
        """Stops what runs besides steps (a background warm-up's compiles; multi-host followers)."""
        self.runner.stop_warmup()
        if self.runner.leader is not None:
            self.runner.leader.stop()

    def add_sequences(self, sequences: list[Request], grammar: CompiledGrammar | None = None) -> None:
        """Queues a request's sequences; with `grammar`, each gets its own matcher. Raises ValueError if
        the cache cannot hold them (all n have the same size: either none is added or all are)."""
        for sequence in sequences:
            self.scheduler.check_fits(sequence.max_num_tokens)
        matchers = [grammar.matcher() if grammar is not None else None for _ in sequences]  # may raise: first
        for sequence, matcher in zip(sequences, matchers, strict=True):
            sequence.grammar = matcher
            self.scheduler.add_request(sequence)

    def finish(self, seq_ids: list[str], status: RequestStatus) -> None:
        """Ends sequences wherever they are (a stop string, an abort); their pages are free when this returns."""
        self.scheduler.finish_requests(seq_ids, status)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        return EngineStats(
            len(scheduler.running), len(scheduler.waiting), self.kv_cache.usage,
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=scheduler.prefix_cache_queries,
            prefix_cache_hits=scheduler.prefix_cache_hits,
            iteration_tokens_buckets=tuple(scheduler.iteration_tokens.bucket_counts),
            iteration_tokens_sum=scheduler.iteration_tokens.sum,
        )

    def step(self) -> list[CoreUpdate]:
        """Schedules and launches a step, reads a step's tokens, and reports every sequence that made progress.

        Synchronous: launches step N and reads it. Async: launches N + 1, then reads N (the first call reads
        nothing); while a sequence has a grammar, or when nothing is left to run, it reads what is in
        flight without launching.
        A fault caused by one sequence's data fails that sequence (its update carries `error`); any other
        exception (the device, the runtime) propagates: the core cannot vouch for its state.
        """
        previous, self._in_flight = self._in_flight, None
        updates: list[CoreUpdate] = []
        if previous is None or not self._needs_last_tokens():
            self._in_flight, updates = self._launch()
        if previous is not None:
            updates += self._read(previous)
        if self._in_flight is not None and (not self.async_scheduling or not self.scheduler.has_unfinished()):
            launched, self._in_flight = self._in_flight, None  # synchronous, or nothing left to overlap
            updates += self._read(launched)
        return updates

    def _launch(self) -> tuple[LaunchedStep | None, list[CoreUpdate]]:
        scheduler_output = self.scheduler.schedule()
        try:
            launched = self.runner.launch(scheduler_output)  # also drops finished requests' state
        except RequestFault as fault:
            # Nothing ran on the device. The other scheduled sequences keep their pages and go back to
            # where they were, so the next schedule() plans them again.
            self.scheduler.unschedule(scheduler_output)
            cause = fault.__cause__ or fault
            logger.error("sequence %s failed and was dropped: %r", fault.request_id, cause, exc_info=cause)
            self.finish([fault.request_id], RequestStatus.FINISHED_ABORTED)
            if isinstance(cause, InvalidParam):  # the request's own values: its client is told what and where
                error, param = str(cause), cause.param
            else:
                error, param = engine_fault(cause), None
            return None, [SequenceUpdate(fault.request_id, None, status=RequestStatus.FINISHED_ABORTED,
                                         error=error, error_param=param)]
        if launched is None:
            self.scheduler.unschedule(scheduler_output)  # an empty step: nothing to read
        return launched, []

    def _read(self, launched: LaunchedStep) -> list[CoreUpdate]:
        """The step's updates: its plain tokens as one `TokenColumns`, every other sequence's `SequenceUpdate`."""
        step_output = self.runner.collect(launched)
        updates: list[CoreUpdate] = []
        seq_ids, token_ids, logprobs = [], [], []
        time = 0.0
        for request in self.scheduler.update(launched.scheduler_output, step_output):
            plain = len(request.output_token_ids) > 1 and not request.status.is_finished  # not first, not last
            # and nothing else to carry: no top logprobs, no preemption count (a stop string may end it next)
            if plain and not request.sampling_params.logprobs and not request.num_preemptions:
                seq_ids.append(request.request_id)
                token_ids.append(request.output_token_ids[-1])
                logprobs.append(request.output_logprobs[-1])
                time = request.last_token_time  # one stamp for the step's tokens
            else:
                updates.append(_update(request))
        if seq_ids:
            updates.append(TokenColumns(seq_ids, token_ids, logprobs, time))
        return updates

    def _needs_last_tokens(self) -> bool:
        """A grammar's next mask depends on the token in flight: the next step waits for it."""
        return any(request.grammar is not None for request in self.scheduler.requests.values())


def _update(request: Request) -> SequenceUpdate:
    """The update for a sequence that just received a token."""
    first = None
    if len(request.output_token_ids) == 1:
        first = FirstToken(
            request.first_scheduled_time, request.num_cached_tokens,
            None if request.sampling_params.prompt_logprobs is None else list(request.prompt_logprobs))
    status = request.status
    if request.grammar_error is not None:  # the request's grammar, not the engine (e.g. over its limits)
        logger.error("sequence %s failed and was dropped: its grammar: %s", request.request_id, request.grammar_error)
        return SequenceUpdate(request.request_id, None, status=status, first=first,
                              error=f"the structured output failed during generation: {request.grammar_error}",
                              error_param="structured_outputs")
    return SequenceUpdate(
        request.request_id, request.output_token_ids[-1], request.output_logprobs[-1],
        request.output_top_logprobs[-1] if request.sampling_params.logprobs else None,
        status if status.is_finished else None, request.stop_reason, request.last_token_time,
        request.num_preemptions, first,
    )
