"""LLMEngine: add_request / abort_request / step, single-threaded and synchronous.

A request with n > 1 becomes n sequences ("<id>#<i>") sharing the prompt; its RequestOutput gathers
their completions. The scheduler sees only sequences.

With async scheduling (`SchedulerConfig.async_scheduling`), `step()` schedules and launches step N + 1,
then reads step N's tokens while the device runs N + 1, and reports N's outputs: the host's work for a
step overlaps the device's. The outputs are the synchronous loop's; a stop is seen one step late, and
the token the extra step sampled is dropped. A request with a grammar needs its last token to build its
next mask, so while one is present the loop reads each step before launching the next.
"""

import copy
import dataclasses
import logging
import os
from dataclasses import dataclass

import jax
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.request import Request, RequestFault, RequestStatus, finish_reason, request_metrics
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.structured_output import CompiledGrammar, GrammarCompiler
from jaxserve.models.loader import LoadedModel, load_model
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.runner import multihost
from jaxserve.runner.batch import MAX_BIASED_TOKENS
from jaxserve.runner.buckets import BucketLadder
from jaxserve.runner.model_runner import LaunchedStep, ModelRunner
from jaxserve.sampling_params import InvalidParam, RequestLimits, SamplingParams, check_cache_salt

logger = logging.getLogger(__name__)


def enable_compilation_cache(cache_dir: str | None) -> None:
    if not cache_dir:  # None or "": no persistent cache
        return
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@dataclass
class _Sequence:
    request: Request
    detokenizer: IncrementalDetokenizer
    parent: "_RequestState"
    num_sent_tokens: int = 0


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(seq.request.status.is_finished for seq in self.sequences)

    def output(self, index: int) -> CompletionOutput:
        seq = self.sequences[index]
        request = seq.request
        finished = request.status.is_finished
        delta_ids = request.output_token_ids[seq.num_sent_tokens :]
        seq.num_sent_tokens = request.num_output_tokens
        return CompletionOutput(
            index=index,
            text=seq.detokenizer.text,
            token_ids=list(request.output_token_ids),
            logprobs=list(request.output_logprobs) if request.sampling_params.logprobs is not None else None,
            top_logprobs=list(request.output_top_logprobs) if request.sampling_params.logprobs else None,
            finish_reason=finish_reason(request.status),
            stop_reason=request.stop_reason,
            text_delta=seq.detokenizer.take_delta(finished),
            token_ids_delta=delta_ids,
        )


class LLMEngine:
    def __init__(self, config: EngineConfig, model: LoadedModel | None = None, warmup: bool = True) -> None:
        if config.parallel.multihost:
            multihost.initialize(config.parallel)  # before the first jax backend call
        enable_compilation_cache(config.compilation_cache_dir)
        self.config = config
        if model is None:
            model = load_model(
                config.model.model, config.model.dtype, config.attention_impl, config.model.revision,
                config.parallel.tensor_parallel_size,
            )
        self.model = model
        self.tokenizer = model.tokenizer
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
        self._requests: dict[str, _RequestState] = {}
        self._sequences: dict[str, _Sequence] = {}  # by sequence ("<id>#<i>") id: the scheduler's request ids
        self.async_scheduling = sched.async_scheduling
        self._in_flight: LaunchedStep | None = None  # launched, not read yet (async scheduling)
        # Its own tokenizer copy: the server compiles grammars on another thread.
        self.grammars = GrammarCompiler(copy.deepcopy(self.tokenizer), model.cfg.vocab_size, model.eos_token_ids)
        self._seed_rng = np.random.default_rng(config.model.seed)
        self.limits = RequestLimits(
            vocab_size=model.cfg.vocab_size,
            max_model_len=self.max_model_len,
            max_logprobs=config.model.max_logprobs,
            max_biased_tokens=MAX_BIASED_TOKENS,
            num_eos_tokens=len(model.eos_token_ids),
            kv_capacity_tokens=self.kv_cache.num_usable_pages * self.kv_cache.page_size,
        )
        self.warmup_seconds = self.runner.warmup(background=config.background_warmup) if warmup else 0.0
        if config.parallel.multihost and config.parallel.is_leader:  # every process has warmed up alike
            self.runner.leader = multihost.Leader(config.parallel)

    def shutdown(self) -> None:
        """Stops what runs besides steps (a background warm-up's compiles; multi-host followers)."""
        self.runner.stop_warmup()
        if self.runner.leader is not None:
            self.runner.leader.stop()

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> None:
        """Queues a request. Raises ValueError for bad input and leaves the engine untouched.

        `cache_salt` (vLLM's): requests share cached prefix pages only with requests of the same salt.
        `grammar`: `params.structured_outputs` compiled already (the server compiles off this thread);
        compiled here when not given."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            prompt_text: str | None = prompt
            prompt_token_ids = self.tokenizer.encode(prompt) if prompt else []
        else:
            prompt_text, prompt_token_ids = None, [int(t) for t in prompt]
        self.limits.check(prompt_token_ids, params)  # InvalidParam (a ValueError) for what cannot be served
        check_cache_salt(cache_salt)
        if params.structured_outputs is not None and grammar is None:
            grammar = self.grammars.compile(params.structured_outputs)
        state = _RequestState(request_id, prompt_text, prompt_token_ids)
        # The first sequence computes prompt logprobs (they are the request's); the others may read its
        # prompt from the prefix cache.
        sibling_params = params if params.prompt_logprobs is None else dataclasses.replace(params, prompt_logprobs=None)
        for index in range(params.n):
            seed = self._seed_rng.integers(2**32) if params.seed is None else params.seed + index
            request = Request(
                request_id=f"{request_id}#{index}",
                prompt_token_ids=prompt_token_ids,
                sampling_params=params if index == 0 else sibling_params,
                eos_token_ids=self.model.eos_token_ids,
                max_model_len=self.max_model_len,
                sampling_seed=int(seed) % 2**32,
                cache_salt=cache_salt,
                grammar=grammar.matcher() if grammar is not None else None,
            )
            detok = IncrementalDetokenizer.for_prompt(self.tokenizer, prompt_token_ids, params)
            state.sequences.append(_Sequence(request, detok, state))
        for seq in state.sequences:
            # Raises if the cache cannot hold the request; all n sequences have the same size, so
            # either the first one raises or none does.
            self.scheduler.add_request(seq.request)
        self._requests[request_id] = state
        self._sequences.update((seq.request.request_id, seq) for seq in state.sequences)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Drops requests wherever they are; their pages are free when this returns."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            state = self._requests.get(request_id)
            if state is not None:
                self._forget(state)
                ids = [seq.request.request_id for seq in state.sequences]
                self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        """Schedules and launches a step, reads a step's tokens, and reports every request that made progress.

        Synchronous: launches step N and reads it. Async: launches N + 1, then reads N (the first call reads
        nothing); while a request has a grammar, or when nothing is left to run, it reads what is in flight
        without launching.
        A fault caused by one request's data fails that request alone (its output carries `error`); any
        other exception (the device, the runtime) propagates: the engine cannot vouch for its state.
        """
        previous, self._in_flight = self._in_flight, None
        outputs: list[RequestOutput] = []
        if previous is None or not self._needs_last_tokens():
            self._in_flight, outputs = self._launch()
        if previous is not None:
            outputs += self._read(previous)
        if self._in_flight is not None and (not self.async_scheduling or not self._requests):
            launched, self._in_flight = self._in_flight, None  # synchronous, or nothing left to overlap
            outputs += self._read(launched)
        return outputs

    def _launch(self) -> tuple[LaunchedStep | None, list[RequestOutput]]:
        scheduler_output = self.scheduler.schedule()
        try:
            launched = self.runner.launch(scheduler_output)  # also drops finished requests' state
        except RequestFault as fault:
            # Nothing ran on the device. The other scheduled requests keep their pages and go back to
            # where they were, so the next schedule() plans them again.
            self.scheduler.unschedule(scheduler_output)
            return None, [self._fail(fault.request_id, fault.__cause__ or fault)]
        if launched is None:
            self.scheduler.unschedule(scheduler_output)  # an empty step: nothing to read
        return launched, []

    def _read(self, launched: LaunchedStep) -> list[RequestOutput]:
        step_output = self.runner.collect(launched)
        return self._process(self.scheduler.update(launched.scheduler_output, step_output))

    def _needs_last_tokens(self) -> bool:
        """A grammar's next mask depends on the token in flight: the next step waits for it."""
        return any(request.grammar is not None for request in self.scheduler.requests.values())

    def _process(self, advanced: list[Request]) -> list[RequestOutput]:
        touched: dict[str, _RequestState] = {}
        failed: list[RequestOutput] = []
        for request in advanced:
            seq = self._sequences.get(request.request_id)
            if seq is None:  # failed earlier in this loop (another of its n sequences)
                continue
            state = seq.parent
            if request.grammar_error is not None:  # the request's grammar, not the engine (e.g. over its limits)
                failed.append(self._fail(request.request_id, InvalidParam(
                    f"the structured output failed during generation: {request.grammar_error}",
                    "structured_outputs")))
                touched.pop(state.request_id, None)
                continue
            try:
                stopped = seq.detokenizer.add_token(request.output_token_ids[-1])
            except Exception as e:
                failed.append(self._fail(request.request_id, e))
                touched.pop(state.request_id, None)
                continue
            if stopped and not request.status.is_finished:
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
                request.stop_reason = seq.detokenizer.stop_reason
            touched[state.request_id] = state
        outputs = []
        for request_id, state in touched.items():
            finished = state.finished
            first = state.sequences[0].request
            outputs.append(
                RequestOutput(
                    request_id, state.prompt, state.prompt_token_ids,
                    [state.output(i) for i in range(len(state.sequences))], finished,
                    metrics=request_metrics([seq.request for seq in state.sequences]) if finished else None,
                    num_cached_tokens=first.num_cached_tokens,
                    prompt_logprobs=(None if first.sampling_params.prompt_logprobs is None
                                     else [None, *first.prompt_logprobs]),
                )
            )
            if finished:
                self._forget(state)
        return outputs + failed

    def _forget(self, state: _RequestState) -> None:
        del self._requests[state.request_id]
        for seq in state.sequences:
            del self._sequences[seq.request.request_id]

    def _fail(self, sequence_id: str, cause: BaseException) -> RequestOutput:
        """Ends the request that sequence `sequence_id` belongs to (all its n sequences) after `cause`
        and reports it as failed."""
        state = self._sequences[sequence_id].parent
        parent_id = state.request_id
        logger.error("request %s failed and was dropped: %r", parent_id, cause, exc_info=cause)
        self._forget(state)
        ids = [seq.request.request_id for seq in state.sequences]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        completions = [CompletionOutput(index=i, finish_reason="error") for i in range(len(ids))]
        if isinstance(cause, InvalidParam):  # the request's own values: its client is told what and where
            return RequestOutput(parent_id, state.prompt, state.prompt_token_ids, completions, finished=True,
                                 error=str(cause), error_param=cause.param)
        return RequestOutput(parent_id, state.prompt, state.prompt_token_ids, completions, finished=True,
                             error=f"the engine failed while processing this request: {type(cause).__name__}")
