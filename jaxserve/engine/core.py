"""EngineCore: the scheduler, the KV pages and the model runner; sequences in, token updates out.

It knows sequences only (the frontend splits a request with n > 1 into n of them) and token ids: no
text, no `RequestOutput`. `step()` reports every sequence that made progress (`CoreOutputs`). Before a
step runs, the core fills the token bitmasks of the sequences sampling under a grammar: the runner gets
the masks, never a matcher.
The frontend (`LLMEngine`) detokenizes, finds stop strings and tells the core which sequences to finish.
That split is what lets the core run in its own process (`core_process`), where its loop does nothing but
schedule, launch and read steps.

With async scheduling (`SchedulerConfig.async_scheduling`), `step()` schedules and launches step N + 1,
then reads step N's tokens while the device runs N + 1, and reports N's updates: the host's work for a
step overlaps the device's. The updates are the synchronous loop's; a stop is seen one step late, and the
token the extra step sampled is dropped. A sequence with a grammar needs its last token to build its
next mask, so while one is present the loop reads each step before launching the next.

Multi-step decoding (`SchedulerConfig.num_scheduler_steps`): once every running sequence only decodes, the
loop launches k decode steps in one call, reporting one `CoreOutputs` per step. Synchronously it reads what
is in flight first and reads the k steps at once (a stop is seen when the k tokens are read). With async
scheduling the calls overlap as single steps do: call N + 1 starts from call N's last tokens on the device,
and N is read while N + 1 runs, so the device does not wait through the host's turn; a stop is then seen
one call late, and the k tokens computed past it are dropped. While a background warm-up is still
compiling (the k-step executables come last), decodes run one step at a time.

Speculative decoding (`SchedulerConfig.speculative_config`) runs under the same conditions: the loop reads
what is in flight, launches a step whose requests with n-gram drafts decode on a row per draft, and reads it
at once (the next step's positions depend on the drafts accepted), reporting one `CoreOutputs` per position.
While drafting may run, decode steps are read in the call that launched them (timed for the draft policy);
while it pauses (`scheduler.DRAFT_PAUSE_STEPS`), they overlap as without drafts.
"""

import dataclasses
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxserve import IMPORTED_AT
from jaxserve.collector import fewer_collections
from jaxserve.config import (
    AUTO_MAX_MODEL_LEN,
    FEATURE_METHODS,
    CacheConfig,
    EngineConfig,
    SpeculativeConfig,
    context_served,
)
from jaxserve.engine import draft_model_proposer
from jaxserve.engine.core_io import (
    CoreOutputs,
    EngineInfo,
    EngineStats,
    FirstToken,
    SequenceDetails,
    SequenceFailure,
    engine_fault,
    failed,
)
from jaxserve.engine.draft_model_proposer import DraftModelProposer, draft_share
from jaxserve.engine.eagle_proposer import EagleProposer, check_target_windows
from jaxserve.engine.kv_cache_manager import KVCacheManager, shared_window
from jaxserve.engine.ngram_proposer import NgramProposer
from jaxserve.engine.pooling_mode import encoder_config, encoder_context, resolved_pooling_type, resolved_runner
from jaxserve.engine.proposer import Proposer
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.step_io import RequestFault, SchedulerOutput, bitmask_words
from jaxserve.engine.structured_output import CompiledGrammar, MaskFiller
from jaxserve.engine.suffix_proposer import SuffixProposer
from jaxserve.models import is_encoder
from jaxserve.models.classifier import class_activation, class_labels, num_classes, score_activation
from jaxserve.models.eagle import load_eagle
from jaxserve.models.layers import LoraShape
from jaxserve.models.loader import LoadedModel, fast_cpu_dtypes, load_model
from jaxserve.models.lora import lora_layout, with_lora_slots
from jaxserve.models.mtp import load_mtp
from jaxserve.models.peft import LoraAdapter
from jaxserve.models.tokenizer import TokenizerCopies
from jaxserve.process_exit import guard_cache_writes
from jaxserve.runner import multihost
from jaxserve.runner.buckets import BucketLadder
from jaxserve.runner.model_runner import LaunchedStep, ModelRunner
from jaxserve.runner.step_batch import MAX_BIASED_TOKENS
from jaxserve.sampling_params import InvalidParam, RequestLimits

logger = logging.getLogger(__name__)

# A host's turn longer than this between two steps is a stall (a collection, an adapter loaded), not a turn.
MAX_HOST_TURN_S = 1.0


def enable_compilation_cache(cache_dir: str | None) -> None:
    if not cache_dir:  # None or "": no persistent cache
        return
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cache_dir))
    guard_cache_writes()  # a server's exit waits for an entry's write under way (process_exit.py)
    # Every compile, the small ones too (a dummy draw, the penalty-row load): a warm start then compiles nothing.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def drafter_cache(cache: CacheConfig, draft: LoadedModel) -> CacheConfig:
    """The cache config of a draft model's or an EAGLE or MTP drafter's runner, as its share of the KV budget
    is sized (`draft_share`) and as its runner allocates: the target's, but an EAGLE or MTP drafter's cache is
    never FP8 (an FP8 cache's scales are folded into a model's weights as it loads, which a drafter's are not)."""
    if getattr(draft.cfg, "feature_width", 0) and cache.kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return dataclasses.replace(cache, kv_cache_dtype="auto")
    return cache


class EngineCore:
    @fewer_collections()  # loading and the warm-up's tracing (collector.py)
    def __init__(self, config: EngineConfig, model: LoadedModel | None = None, warmup: bool = True,
                 tokenizer_copies: int = 0) -> None:
        """`tokenizer_copies`: copies of the tokenizer to make during the warm-up for the threads of an engine
        in this process (`LLMEngine`); a core in a process of its own makes none."""
        if config.parallel.multihost:
            multihost.initialize(config.parallel)  # before the first jax backend call
        enable_compilation_cache(config.compilation_cache_dir)
        _start_backend()
        config = _with_fast_cpu_dtypes(config)
        self.config = config
        if model is None:
            model = load_model(
                config.model.model, config.model.dtype, config.attention_impl, config.model.revision,
                config.parallel.tensor_parallel_size, config.model.weight_dtype, config.model.load_format,
                kv_cache_dtype=config.cache.kv_cache_dtype,
                expert_parallel=config.parallel.enable_expert_parallel,
                quantization=config.model.quantization,
                download_dir=config.model.download_dir,
                hf_overrides=config.model.hf_overrides,
                tokenizer=config.model.tokenizer,
                tokenizer_revision=config.model.tokenizer_revision,
                # the weights load while the steps compile (one process: a multi-host job's processes load,
                # size and compile in step with each other)
                in_background=not config.parallel.multihost,
            )
        try:
            self._start(config, model, warmup, tokenizer_copies)
        except BaseException:
            model.abandon_loading()  # a failed start leaves no load going on beside whatever comes next
            raise

    def _start(self, config: EngineConfig, model: LoadedModel, warmup: bool, tokenizer_copies: int) -> None:
        """The rest of a start, once the model is loaded or loading: the runner (KV cache, compiles), the
        scheduler, the warm-up."""
        config = self.config = resolved_runner(config, model)
        encoder = is_encoder(model.cfg)
        if encoder:  # its prompts whole in a step, its pages only those of the steps in flight
            config = self.config = encoder_config(config, encoder_context(model.max_position_embeddings,
                                                                          model.source))
        if config.lora.enable_lora:
            model = with_lora_slots(model, LoraShape(config.lora.max_loras, config.lora.max_lora_rank))
            logger.info("LoRA: %d slot(s) of rank %d in every dense projection", config.lora.max_loras,
                        config.lora.max_lora_rank)
        self.model = model
        asked = config.model.max_model_len
        self.max_model_len = context_served(asked, model.max_position_embeddings)
        if self.max_model_len < (asked or 0):
            logger.warning("--max-model-len %d is longer than the model's context, %d: serving %d (a RoPE-scaled "
                           "context is set with --hf-overrides)", config.model.max_model_len,
                           model.max_position_embeddings, self.max_model_len)
        sched = config.scheduler
        pooling = config.runner == "pooling"  # prompts embedded, nothing decoded: no decode variants
        self.pooling_type = resolved_pooling_type(config.pooling_type, model) if pooling else None
        ladder = BucketLadder(
            config.buckets.token_buckets, config.buckets.request_buckets,
            sched.max_num_batched_tokens, sched.max_num_seqs,
        )
        leads = config.parallel.multihost and config.parallel.is_leader
        self.leader = multihost.Leader(config.parallel) if leads else None  # listens; accepts after warm-up
        speculative = None if pooling else sched.speculative_config
        # A draft model loads before the runner sizes its KV cache: the pages are shared out between the two.
        method = None if speculative is None else speculative.method
        reads_features = method in FEATURE_METHODS  # the target keeps features for it (`models/features.py`)
        draft_model = (self._load_draft(config, speculative) if method == "draft_model"
                       else self._load_mtp(model) if method == "mtp"
                       else self._load_eagle(config, speculative, model) if reads_features else None)
        # its final hidden states for an EAGLE or MTP drafter, the inputs of some of its layers for an EAGLE-3 one
        feature_layers = getattr(draft_model.cfg, "target_layers", ()) if reads_features else None
        share = (draft_share(draft_model, model, drafter_cache(config.cache, draft_model), sched.max_num_seqs)
                 if draft_model is not None else None)
        self.runner = ModelRunner(
            model, config.cache, ladder, self.max_model_len, sched.max_num_seqs, config.model.max_logprobs,
            broadcast=self.leader.send if self.leader is not None else None,
            greedy_decodes=config.buckets.greedy_decodes and not pooling,
            num_decode_steps=1 if pooling else sched.num_scheduler_steps, pooling=pooling,
            temp_records_dir=config.compilation_cache_dir or None,
            enforce_eager=config.enforce_eager,
            fit_to_cache=asked == AUTO_MAX_MODEL_LEN,
            max_drafts=0 if pooling else sched.max_drafts,
            draft=share,
            feature_layers=feature_layers,
        )
        self.max_model_len = self.runner.max_model_len
        self.kv_cache = KVCacheManager(self.runner.num_pages, config.cache.page_size,
                                       config.cache.enable_prefix_caching,
                                       shared_window(getattr(model.cfg, "sliding_windows", ())))
        if self.kv_cache.capacity_tokens < self.max_model_len:  # as vLLM would refuse to start
            logger.warning("the KV cache holds %d tokens, fewer than the %d of the context served: a longer request "
                           "is refused; --max-model-len auto serves what the cache holds, and a larger cache "
                           "(--kv-cache-memory, --gpu-memory-utilization, --num-kv-pages) serves more",
                           self.kv_cache.capacity_tokens, self.max_model_len)
        proposer: Proposer | None = None
        if reads_features:
            proposer = EagleProposer(self._draft_runner(config, draft_model, ladder), self.runner,
                                     speculative.num_speculative_tokens, model.cfg.vocab_size)
        elif draft_model is not None:
            proposer = DraftModelProposer(self._draft_runner(config, draft_model, ladder),
                                          speculative.num_speculative_tokens, model.cfg.vocab_size,
                                          config.cache.enable_prefix_caching)
        elif speculative is not None and speculative.method == "suffix":
            proposer = SuffixProposer(speculative.num_speculative_tokens, speculative.suffix_decoding_max_tree_depth,
                                      speculative.suffix_decoding_max_cached_requests,
                                      speculative.suffix_decoding_max_spec_factor,
                                      speculative.suffix_decoding_min_token_prob)
        elif speculative is not None:
            proposer = NgramProposer(speculative.num_speculative_tokens, speculative.prompt_lookup_min,
                                     speculative.prompt_lookup_max)
        self.draft_runner = proposer.runner if isinstance(proposer, DraftModelProposer) else None
        self.scheduler = Scheduler(self.kv_cache, sched.max_num_seqs, sched.max_num_batched_tokens,
                                   sched.num_scheduler_steps, sched.scheduling_policy, proposer,
                                   row_buckets=self.runner.ladder.request_buckets,
                                   max_loras=config.lora.max_loras if config.lora.enable_lora else 0,
                                   overlap_decode_steps=sched.async_scheduling,
                                   disable_by_batch_size=None if speculative is None
                                   else speculative.disable_by_batch_size, whole_prompts=encoder)
        self.async_scheduling = sched.async_scheduling
        self._in_flight: LaunchedStep | None = None  # launched, not read yet (async scheduling)
        self._launched_at = 0.0  # perf_counter() when the last step was launched
        self._collected_at = 0.0  # perf_counter() when the last step's tokens were read, before their outputs
        # That time for a step read at once while drafts may run: the host's turn from there to the next plan
        # is timed for the draft policy (`_launch`); None otherwise.
        self._sync_read_at: float | None = None
        self._masks = MaskFiller()
        self._retiring_loras: set[int] = set()  # removed adapters that unfinished requests still use
        # Whether requests not yet in the scheduler use an adapter (a core process's, while their grammars
        # compile): a removed adapter stays for them too.
        self.lora_waiting: Callable[[int], bool] = lambda lora_id: False
        self.limits = RequestLimits(
            vocab_size=model.cfg.vocab_size,
            max_model_len=self.max_model_len,
            max_logprobs=config.model.max_logprobs,
            max_biased_tokens=MAX_BIASED_TOKENS,
            num_eos_tokens=len(model.eos_token_ids),
            kv_capacity_tokens=self.kv_cache.capacity_tokens,
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
            scheduling_policy=sched.scheduling_policy,
            runner=config.runner,
            hidden_size=model.cfg.hidden_size,
            class_labels=class_labels(model.hf_config, num_classes(model.cfg)),
            class_activation=class_activation(model.hf_config, num_classes(model.cfg)),
            score_activation=score_activation(model.hf_config, num_classes(model.cfg)),
            enable_prefix_caching=self.kv_cache.enable_prefix_caching,
            eos_token_ids=tuple(model.eos_token_ids),
            dtype=model.dtype.dtype.name,
            weight_dtype=model.weight_dtype.dtype.name,
            lora_layout=lora_layout(model) if config.lora.enable_lora else None,
            matryoshka=bool(getattr(model.hf_config, "is_matryoshka", False)
                            or getattr(model.hf_config, "matryoshka_dimensions", None)),
        )
        # a multi-host job warms up fully: every process must run the same buckets in the same order
        mode = "full" if config.parallel.multihost else config.warmup_mode
        # The tokenizer's copies for the threads above (`TokenizerCopies`), made while the first step runs
        self.tokenizer_copies = TokenizerCopies(model.tokenizer, tokenizer_copies)
        self.warmup_seconds = self.runner.warmup(mode=mode, meanwhile=self.tokenizer_copies.make) if warmup else 0.0
        if warmup and self.draft_runner is not None:
            self.warmup_seconds += self.draft_runner.warmup(show_progress=False, mode=mode)
        if warmup and isinstance(proposer, EagleProposer):
            proposer.warmup()
        self.runner.wait_for_weights()  # a start fails with its load's error, not the first step
        if self.leader is not None:  # every process has warmed up alike
            self.leader.accept_followers()

    def _load_draft(self, config: EngineConfig, speculative: SpeculativeConfig) -> LoadedModel:
        """The draft model (--speculative-config's "model"), loaded as the target is (its dtypes, attention,
        load format, split over the same devices), a GGUF file's quantized blocks kept where they run."""
        logger.info("speculative decoding: loading the draft model %s", speculative.model)
        try:
            return load_model(speculative.model, config.model.dtype, config.attention_impl, speculative.revision,
                              config.parallel.tensor_parallel_size, config.model.weight_dtype,
                              config.model.load_format, kv_cache_dtype=config.cache.kv_cache_dtype,
                              expert_parallel=config.parallel.enable_expert_parallel, require_experts=False,
                              quantization=speculative.quantization or "auto", download_dir=config.model.download_dir)
        except (OSError, ValueError) as error:  # a path, a hub id, a config or file it cannot read
            raise ValueError(f"the draft model (--speculative-config's \"model\"): {error}") from error

    def _load_eagle(self, config: EngineConfig, speculative: SpeculativeConfig, target: LoadedModel) -> LoadedModel:
        """The EAGLE drafter (--speculative-config's "model"), beside `target` (`models/eagle.py`); a target
        windowed on every layer is refused (`check_target_windows`)."""
        logger.info("speculative decoding: loading the EAGLE drafter %s", speculative.model)
        try:
            check_target_windows(target.cfg)
            return load_eagle(speculative.model, target, speculative.method, speculative.revision,
                              config.model.download_dir)
        except (OSError, ValueError) as error:  # a path, a hub id, a config or file it cannot read
            raise ValueError(f"the EAGLE drafter (--speculative-config's \"model\"): {error}") from error

    def _load_mtp(self, target: LoadedModel) -> LoadedModel:
        """The target's own multi-token prediction layer as its drafter (`models/mtp.py`)."""
        logger.info("speculative decoding: loading the model's multi-token prediction layer")
        try:
            return load_mtp(target)
        except (OSError, ValueError) as error:
            raise ValueError(f"speculative method \"mtp\": {error}") from error

    def _draft_runner(self, config: EngineConfig, draft: LoadedModel, ladder: BucketLadder) -> ModelRunner:
        """The draft model's runner: the target's buckets, greedy rows, and as many KV pages as the target's
        (their memory counted in the target's sizing: `DraftShare`)."""
        k = config.scheduler.speculative_config.num_speculative_tokens
        cache = dataclasses.replace(drafter_cache(config.cache, draft), num_kv_pages=self.runner.num_pages)
        max_len = context_served(self.max_model_len, draft.max_position_embeddings)
        if (asked := config.scheduler.speculative_config.max_model_len) is not None:
            max_len = min(max_len, asked)
        # k - 1 decode steps in one call on GPUs; a call a step on CPUs (`DraftModelProposer._decode`)
        steps = max(1, k - 1) if draft_model_proposer.one_call_decodes(jax.default_backend()) else 1
        return ModelRunner(draft, cache, ladder, max_len, config.scheduler.max_num_seqs, max_logprobs=1,
                           greedy_decodes=True, num_decode_steps=steps, enforce_eager=config.enforce_eager)

    def shutdown(self) -> None:
        """Stops what runs besides steps (a background warm-up's compiles; multi-host followers)."""
        self.runner.stop_warmup()
        if self.draft_runner is not None:
            self.draft_runner.stop_warmup()
        if self.leader is not None:
            self.leader.stop()

    def add_sequences(self, sequences: list[Request], grammar: CompiledGrammar | None = None) -> None:
        """Queues a request's sequences (checked by the frontend against `self.limits`); with `grammar`,
        each gets its own matcher. Raises ValueError if the cache cannot hold them (all n have the same
        size: the first is refused, so either none is added or all are)."""
        lora_id = sequences[0].lora_id
        if lora_id is not None and (self.runner.lora is None or lora_id not in self.runner.lora.adapters):
            # (a request accepted before its adapter's removal keeps it, retiring or not: `lora_waiting`)
            raise InvalidParam(f"the LoRA adapter of this request (id {lora_id}) was removed", "model")
        matchers = [grammar.matcher(sequence.sampling_params.structured_outputs.after_token_ids)
                    if grammar is not None else None for sequence in sequences]  # may raise: first
        for sequence, matcher in zip(sequences, matchers, strict=True):
            sequence.grammar = matcher
            if self.pooling_type is not None:
                sequence.pool(self.pooling_type)
            self.scheduler.add_request(sequence)

    def finish(self, seq_ids: list[str], status: RequestStatus) -> None:
        """Ends sequences wherever they are (a stop string, an abort); their pages are free when this returns."""
        self.scheduler.finish_requests(seq_ids, status)
        self.drop_retired_loras()

    def add_lora(self, lora_id: int, adapter: LoraAdapter) -> None:
        """Serves `adapter` under `lora_id` (read and checked by the frontend, `LLMEngine.add_lora`)."""
        self.runner.lora.adapters[lora_id] = adapter
        logger.info("LoRA adapter %s (id %d): rank %d, %d projections, %.1f MiB", adapter.name, lora_id, adapter.rank,
                    len(adapter.weights), adapter.nbytes / 2**20)

    def remove_lora(self, lora_id: int) -> None:
        """Drops adapter `lora_id` once no unfinished request uses it (the frontend takes no new ones)."""
        self._retiring_loras.add(lora_id)
        self.drop_retired_loras()

    def drop_retired_loras(self) -> None:
        """Drops the removed adapters that no unfinished request uses any more (queued, running, or waiting
        outside the scheduler: `lora_waiting`)."""
        if not self._retiring_loras:
            return
        for lora_id in [i for i in self._retiring_loras
                        if not self.scheduler.uses_lora(i) and not self.lora_waiting(i)]:
            self._retiring_loras.discard(lora_id)
            adapter = self.runner.lora.adapters.pop(lora_id, None)
            logger.info("LoRA adapter %s (id %d) removed", adapter.name if adapter else "?", lora_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def start_profile(self, log_dir: str) -> None:
        """Records a `jax.profiler` trace of this process into `log_dir` until `stop_profile`: the steps'
        host work and their device ops, for XProf / TensorBoard (`*.xplane.pb`) and Perfetto
        (`perfetto_trace.json.gz`)."""
        jax.profiler.start_trace(log_dir, create_perfetto_trace=True)
        logger.info("profiling into %s", log_dir)

    def stop_profile(self) -> None:
        """Ends the trace once the device has run what was launched, so the trace holds those steps."""
        try:
            jax.block_until_ready(self.runner.kv_caches)
        finally:  # a device fault still ends the trace, so a later start can begin one
            jax.profiler.stop_trace()
        logger.info("profile written")

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        return EngineStats(
            len(scheduler.running), len(scheduler.waiting), self.kv_cache.usage,
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=scheduler.prefix_cache_queries,
            prefix_cache_hits=scheduler.prefix_cache_hits,
            iteration_tokens_buckets=tuple(scheduler.iteration_tokens.bucket_counts),
            iteration_tokens_sum=scheduler.iteration_tokens.sum,
            spec_decode_num_drafts=scheduler.speculation.num_drafts,
            spec_decode_num_draft_tokens=scheduler.speculation.num_draft_tokens,
            spec_decode_num_accepted_tokens=scheduler.speculation.num_accepted_tokens,
            spec_decode_accepted_per_position=tuple(scheduler.speculation.accepted_per_position),
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict[str, Any]:
        if self.runner.lora is None:
            return {}
        adapters, scheduler = self.runner.lora.adapters, self.scheduler
        waiting = sorted({request.lora_id for request in scheduler.waiting if request.lora_id is not None})
        return {"max_loras": scheduler.lora_slots.max_loras,
                "running_lora_adapters": tuple(adapters[i].name for i in scheduler.lora_slots.running_adapters
                                               if i in adapters),
                "waiting_lora_adapters": tuple(adapters[i].name for i in waiting if i in adapters)}

    def step(self) -> list[CoreOutputs]:
        """Schedules and launches a step, reads a step's tokens, and reports every sequence that made progress.

        Synchronous: launches step N and reads it. Async: launches N + 1, then reads N (the first call reads
        nothing); while a sequence has a grammar, or when nothing is left to run, it reads what is in
        flight without launching. A multi-step decode is launched once nothing is in flight and read at once,
        or, async (`_overlaps_decode_steps`), launched and read as a single step is.
        A fault caused by one sequence's data fails that sequence (a `SequenceFailure`); any other
        exception (the device, the runtime) propagates: the core cannot vouch for its state.
        """
        self.drop_retired_loras()
        # k-step decodes once the runner has their executables (a background warm-up compiles them last)
        self.scheduler.num_scheduler_steps = self.runner.decode_steps_ready()
        previous, self._in_flight = self._in_flight, None
        outputs: list[CoreOutputs] = []
        if previous is not None and self.scheduler.only_decodes() and not self._overlaps_decode_steps():
            # A multi-step decode starts from read tokens: report these now (a first token must not wait
            # for the k steps), and launch the k steps on the next call.
            return self._read(previous)
        if previous is None or not self._needs_last_tokens():
            self._in_flight, failures = self._launch()
            outputs += failures
        if previous is not None:
            outputs += self._read(previous)
        if self._in_flight is not None and (not self.async_scheduling or not self.scheduler.has_unfinished()
                                            or self._in_flight.scheduler_output.is_speculative
                                            or (self._in_flight.scheduler_output.is_multi_step
                                                and not self._overlaps_decode_steps())
                                            or self._drafting()):
            # synchronous, nothing left to overlap, drafts or k steps that the next plan cannot overlap (it
            # needs their tokens), or a decode step while drafts may run next (timed from launch to tokens
            # where it ran alone)
            launched, self._in_flight = self._in_flight, None
            outputs += self._read(launched, timed=previous is None)
            if self.scheduler.draft_policy is not None and (launched.scheduler_output.is_speculative
                                                            or self._drafting()):
                self._sync_read_at = self._collected_at
        return outputs

    def _overlaps_decode_steps(self) -> bool:
        """Async k-step decodes: call N + 1 is launched from call N's last tokens on the device before N is
        read, so the host's turn (N's outputs) runs while the device decodes (`Scheduler.overlap_decode_steps`
        says when)."""
        return self.scheduler.overlap_decode_steps and self.scheduler.num_scheduler_steps > 1

    def _drafting(self) -> bool:
        """Speculative decoding may apply to the next step (on, not paused, every running sequence decoding)."""
        return self.scheduler.drafts_apply()

    def _launch(self) -> tuple[LaunchedStep | None, list[CoreOutputs]]:
        if self._sync_read_at is not None:  # the host's turn since that read: hidden by overlap, paid by drafts
            turn = time.perf_counter() - self._sync_read_at
            # not after the running requests ended (finished, or stopped by the frontend): an idle wait for
            # new ones may have followed
            if self.scheduler.running and turn < MAX_HOST_TURN_S:
                self.scheduler.draft_policy.observe_host_turn(turn)
            self._sync_read_at = None
        plan = self._with_grammar_masks(self.scheduler.schedule())
        self._launched_at = time.perf_counter()
        try:
            launched = self.runner.launch(plan)  # also drops finished requests' state
        except RequestFault as fault:
            # Nothing ran on the device. The other scheduled sequences keep their pages and go back to
            # where they were, so the next schedule() plans them again.
            self.scheduler.unschedule(plan)
            cause = fault.__cause__ or fault
            logger.error("sequence %s failed and was dropped: %r", fault.request_id, cause, exc_info=cause)
            self.finish([fault.request_id], RequestStatus.FINISHED_ABORTED)
            if isinstance(cause, InvalidParam):  # the request's own values: its client is told what and where
                error, param = str(cause), cause.param
            else:
                error, param = engine_fault(cause), None
            return None, [failed([SequenceFailure(fault.request_id, error, param)])]
        if launched is None:
            self.scheduler.unschedule(plan)  # an empty step: nothing to read
        return launched, []

    def _with_grammar_masks(self, plan: SchedulerOutput) -> SchedulerOutput:
        """The plan with the next-token masks of its rows sampling under a grammar, filled from their
        matchers after the last step's tokens were read (llguidance fills them in parallel)."""
        if not plan.grammar_rows:
            return plan
        bitmask = np.empty((len(plan.grammar_rows), bitmask_words(self.model.cfg.vocab_size)), np.int32)
        requests = self.scheduler.requests
        self._masks.fill([(requests[plan.request_ids[row]].grammar, index)
                          for index, row in enumerate(plan.grammar_rows)], bitmask)
        return dataclasses.replace(plan, grammar_bitmask=bitmask)

    def _read(self, launched: LaunchedStep, timed: bool = False) -> list[CoreOutputs]:
        """The step's outputs (one per step of a multi-step decode, one per draft position of a speculative
        one). `timed`: launched with nothing in flight and read at once; a decode step's time then goes to the draft
        policy."""
        plan = launched.scheduler_output
        if timed and self.scheduler.draft_policy is not None and plan.num_tokens == plan.num_reqs:
            jax.block_until_ready(launched.sampled.tokens)
            num_rows = launched.batch.logits_indices.shape[0]  # its bucket's
            self.scheduler.draft_policy.observe_step(num_rows, time.perf_counter() - self._launched_at, plan.num_steps)
        if plan.is_multi_step:
            collected = self.runner.collect_steps(launched)
            self._collected_at = time.perf_counter()
            per_step = self.scheduler.update_steps(plan, collected)
        else:
            output = self.runner.collect(launched)
            self._collected_at = time.perf_counter()
            if not plan.is_speculative:
                return [self._outputs(self.scheduler.update(plan, output))]
            per_step = self.scheduler.update_verified(plan, output)
        unreported = Counter(request.request_id for advanced in per_step for request in advanced)
        return [self._outputs(advanced, unreported) for advanced in per_step]

    def _outputs(self, advanced: list[Request], unreported: Counter | None = None) -> CoreOutputs:
        """Every sequence that received a token, with details for the few that need them. `unreported`:
        per sequence, its new tokens not reported yet (a multi-step decode's, reported a step at a time);
        else each sequence's one new token is its last."""
        seq_ids, token_ids, logprobs, details, failures = [], [], [], {}, []
        read_time = 0.0
        for request in advanced:
            if request.grammar_error is not None:  # its grammar, not the engine (e.g. over its limits)
                logger.error("sequence %s failed and was dropped: its grammar: %s", request.request_id,
                             request.grammar_error)
                failures.append(SequenceFailure(
                    request.request_id, f"the structured output failed during generation: {request.grammar_error}",
                    "structured_outputs"))
                continue
            index = len(request.output_token_ids) - 1  # the token's index among the sequence's outputs
            if unreported is not None:
                index -= unreported[request.request_id] - 1
                unreported[request.request_id] -= 1
            last = index == len(request.output_token_ids) - 1
            # Plain: not its first token, not its last, no logprobs' rank, no preemption count to carry.
            plain = index > 0 and not (last and request.status.is_finished)
            if not plain or request.sampling_params.logprobs is not None or request.num_preemptions:
                details[len(seq_ids)] = _details(request, index)
            seq_ids.append(request.request_id)
            token_ids.append(request.output_token_ids[index])
            logprobs.append(request.output_logprobs[index])
            read_time = request.last_token_time  # one stamp for the step's tokens
        return CoreOutputs(seq_ids, token_ids, logprobs, read_time, details, failures)

    def _needs_last_tokens(self) -> bool:
        """A grammar's next mask (or a bad word's ban) depends on the token in flight: the next step waits
        for it."""
        return any(request.reads_last_token for request in self.scheduler.requests.values())


def _start_backend() -> None:
    """Starts jax's backend (its first device query does) and says which it is and when, counted from
    jaxserve's import: on a GPU, the imports and CUDA's start are the first seconds of every start."""
    devices = jax.devices()
    logger.info("backend: %s, %d x %s, jax %s; ready %.1fs after jaxserve was imported", devices[0].platform,
                len(devices), devices[0].device_kind, jax.__version__, time.monotonic() - IMPORTED_AT)


def _with_fast_cpu_dtypes(config: EngineConfig) -> EngineConfig:
    """The config with `loader.fast_cpu_dtypes`' weights and KV cache (16-bit where all dtypes are auto on a
    CPU with bfloat16 dot products), said in the log when it changes them."""
    model, cache = config.model, config.cache
    weight_dtype, kv_cache_dtype = fast_cpu_dtypes(model.dtype, model.weight_dtype, cache.kv_cache_dtype,
                                                   config.attention_impl)
    if (weight_dtype, kv_cache_dtype) == (model.weight_dtype, cache.kv_cache_dtype):
        return config
    logger.info("dtypes auto on a CPU with bfloat16 dot products: %s weights and KV cache under float32 "
                "activations (--dtype float32 keeps everything float32)", weight_dtype)
    return dataclasses.replace(config, model=dataclasses.replace(model, weight_dtype=weight_dtype),
                               cache=dataclasses.replace(cache, kv_cache_dtype=kv_cache_dtype))


def _details(request: Request, index: int) -> SequenceDetails:
    """What a sequence's new token, its output `index`, carries besides (its first token's facts, an end,
    top logprobs, its rank)."""
    first = None
    if index == 0:
        first = FirstToken(
            request.first_scheduled_time, request.num_cached_tokens,
            None if request.sampling_params.prompt_logprobs is None else list(request.prompt_logprobs))
    status, params = request.status, request.sampling_params
    ended = status.is_finished and index == len(request.output_token_ids) - 1
    return SequenceDetails(
        request.output_top_logprobs[index] if params.logprobs else None,
        status if ended else None, request.stop_reason if ended else None, request.num_preemptions, first,
        request.embedding if ended else None, ended and request.stopped_on_token,
        request.output_ranks[index] if params.logprobs is not None else None,
    )
