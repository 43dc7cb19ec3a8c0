"""LLMEngine: add_request / abort_request / step, called from one thread.

The frontend of an `EngineCore`: it checks and tokenizes requests, splits a request with n > 1 into n
sequences sharing the prompt, and turns the core's token updates into text and `RequestOutput`s
(`OutputProcessor`: detokenizing, stop strings, a request's n completions gathered). A sequence's id,
"<id>#<i>/<serial>", is new for every add: a request id reused after an abort or a stop never receives
what the core still sends for its predecessor.
The core runs here, in this thread, or in its own process (`EngineConfig.engine_process`, vLLM V1's
split: `core_process`), where scheduling and steps no longer share a Python interpreter with
detokenizing and HTTP. Both run the same code on each side of the same records (`core_io`). With
`data_parallel_size` > 1, several cores run, each in its own process on its own devices
(`data_parallel`), and each request goes to one of them.
"""

import dataclasses
import itertools
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxserve.config import EngineConfig, LoraModule
from jaxserve.engine.core_io import EngineCoreClient, EngineInfo, EngineStats
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.structured_output import CompiledGrammar, GrammarCompiler
from jaxserve.models.peft import LoraAdapter, read_adapter
from jaxserve.models.tokenizer import TokenizerCopies, encode_text
from jaxserve.outputs import RequestOutput
from jaxserve.platform import prepare_jax_platform
from jaxserve.sampling_params import InvalidParam, SamplingParams, check_cache_salt, check_priority
from jaxserve.transformers_scan import remember_scans

if TYPE_CHECKING:
    from jaxserve.engine.core import EngineCore
    from jaxserve.engine.kv_cache_manager import KVCacheManager
    from jaxserve.engine.scheduler import Scheduler
    from jaxserve.models.loader import LoadedModel
    from jaxserve.runner.model_runner import LaunchedStep, ModelRunner



def bad_words_token_ids(tokenizer: Any, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """Each bad word as the token sequences that write it: at the start of a text and after a space."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            sequences.append(tuple(tokenizer.encode(text, add_special_tokens=False)))
    return tuple(dict.fromkeys(s for s in sequences if s))


logger = logging.getLogger(__name__)


class AdapterExists(ValueError):
    """A LoRA adapter of that name is served already."""


# The tokenizer's copies that threads of a server take, each its own (`LLMEngine.tokenizer_copy`): the grammar
# compiler's, the async engine's, the event loop's. An offline engine takes one; the others' making hid
# behind the warm-up's first step.
TOKENIZER_COPIES = 3


class ProfilerState(RuntimeError):
    """A profile started while one is recorded, or stopped while none is."""


class LLMEngine:
    def __init__(self, config: EngineConfig, model: "LoadedModel | None" = None, warmup: bool = True) -> None:
        prepare_jax_platform()  # a no-op once jax's backends run; a quiet start for callers that build one first
        remember_scans()  # a no-op once transformers is imported; else its start reads the last one's scans
        self.config = config
        self.async_scheduling = config.scheduler.async_scheduling
        self.core: EngineCore | None  # the core when it runs in this process, else None
        self._core: EngineCoreClient  # the core, here or in its own process
        if config.core_processes:
            if model is not None:
                raise ValueError("engine_process and data_parallel_size > 1 load the model in the cores' "
                                 "processes: pass no model")
            self.core = None
            if config.parallel.data_parallel:
                from jaxserve.engine.data_parallel import DataParallelClient

                self._core = DataParallelClient(config, warmup)
            else:
                from jaxserve.engine.core_process import CoreProcessClient

                self._core = CoreProcessClient(config, warmup)
            self.tokenizer = self._core.tokenizer
        else:
            from jaxserve.engine import core  # imports jax

            self.core = self._core = core.EngineCore(config, model, warmup, tokenizer_copies=TOKENIZER_COPIES)
            self.tokenizer = self.core.model.tokenizer
        # Copies of the tokenizer for threads that use one of their own: made during the warm-up where the
        # core runs here, else as they are taken.
        self._tokenizer_copies = (self.core.tokenizer_copies if self.core is not None
                                  else TokenizerCopies(self.tokenizer, 0))
        self.info: EngineInfo = self._core.info
        # This side's one grammar compiler, with its own tokenizer copy: grammars compile on other threads
        # (the server's) while this one detokenizes.
        self.grammars = GrammarCompiler(self.tokenizer_copy(), self.info.limits.vocab_size,
                                        self.info.eos_token_ids)
        self.limits = self.info.limits
        self.max_model_len = self.limits.max_model_len
        self.warmup_seconds = self._core.warmup_seconds
        self.outputs = OutputProcessor()
        self._seed_rng = np.random.default_rng(config.model.seed)
        self._serials = itertools.count()
        # --enable-lora: the adapters served, by name: (module, id). Replaced whole on a change, so other
        # threads (the server's /v1/models) read a consistent one.
        self.lora_modules: dict[str, tuple[LoraModule, int]] = {}
        self._lora_ids = itertools.count(1)  # vLLM's lora_int_id: never reused, so neither are cache keys
        self.profile_dir: str | None = None  # where the trace being recorded goes; None: none is
        try:
            for module in config.lora.lora_modules:
                self.load_lora(module)
        except BaseException:
            self.shutdown()
            raise

    # The in-process core's parts, for tests and benchmarks.
    @property
    def model(self) -> "LoadedModel":
        return self._in_process().model

    @property
    def scheduler(self) -> "Scheduler":
        return self._in_process().scheduler

    @property
    def runner(self) -> "ModelRunner":
        return self._in_process().runner

    @property
    def kv_cache(self) -> "KVCacheManager":
        return self._in_process().kv_cache

    @property
    def _in_flight(self) -> "LaunchedStep | None":
        return self._in_process()._in_flight

    def _in_process(self) -> "EngineCore":
        if self.core is None:
            raise AttributeError("the engine core runs in its own process")
        return self.core

    def tokenizer_copy(self) -> Any:
        """A copy of the tokenizer for a thread of the caller's that uses no other (`TokenizerCopies`)."""
        return self._tokenizer_copies.take()

    def shutdown(self) -> None:
        """Stops what runs besides steps (a background warm-up's compiles; multi-host followers; the
        core's process); a profile still being recorded is written first, if it can be."""
        try:
            if self.profile_dir is not None:
                self.stop_profile()
        except Exception:  # a dead core, a device fault: the shutdown goes on
            logger.exception("the profile being recorded could not be written")
        finally:
            self._core.shutdown()

    def stats(self) -> EngineStats:
        return self._core.stats()

    def start_profile(self, log_dir: str) -> None:
        """Records a `jax.profiler` trace of the core (each data-parallel rank's in `rank<i>` under
        `log_dir`) until `stop_profile`: vLLM's start_profile, for XProf / TensorBoard and Perfetto."""
        if self.profile_dir is not None:
            raise ProfilerState(f"a profile is being recorded already, into {self.profile_dir}")
        os.makedirs(log_dir, exist_ok=True)  # OSError for a folder that cannot be made, before the core tries
        self._core.start_profile(log_dir)  # a core process's failure is raised here too
        self.profile_dir = log_dir

    def stop_profile(self) -> str:
        """Ends the trace once the device has run what was launched; returns the folder it went to."""
        if self.profile_dir is None:
            raise ProfilerState("no profile is being recorded: start one first")
        log_dir, self.profile_dir = self.profile_dir, None
        self._core.stop_profile()
        return log_dir

    def read_lora(self, module: LoraModule) -> LoraAdapter:
        """Reads and checks the PEFT adapter `module` names (ValueError for one that cannot be served). Any
        thread: nothing of the engine's changes."""
        if self.info.lora_layout is None:
            raise ValueError("LoRA adapters need an engine started with --enable-lora")
        return read_adapter(module.name, module.path, self.info.lora_layout)

    def add_lora(self, module: LoraModule, adapter: LoraAdapter, replace: bool = False) -> int:
        """Serves `adapter` (from `read_lora`) as the model `module.name`; returns its id. ValueError for a
        name already served, unless `replace`: then the adapter served under it is removed first."""
        if module.name in self.lora_modules:
            if not replace:
                raise AdapterExists(f"The lora adapter '{module.name}' has already been loaded.")
            self.remove_lora(module.name)
        lora_id = next(self._lora_ids)
        self._core.add_lora(lora_id, adapter)
        self.lora_modules = {**self.lora_modules, module.name: (module, lora_id)}
        return lora_id

    def load_lora(self, module: LoraModule) -> int:
        """`read_lora` then `add_lora`."""
        return self.add_lora(module, self.read_lora(module))

    def remove_lora(self, name: str) -> None:
        """Stops serving adapter `name`: new requests of it are refused; those already added finish with it.
        KeyError for a name not served."""
        _, lora_id = self.lora_modules[name]
        self.lora_modules = {key: value for key, value in self.lora_modules.items() if key != name}
        self._core.remove_lora(lora_id)

    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        grammar: CompiledGrammar | None = None,
        checked: bool = False,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> None:
        """Queues a request. Raises ValueError for bad input and leaves the engine untouched.

        `lora_name`: one of the engine's LoRA adapters (`--lora-modules`) to generate with; None: the base model.

        `cache_salt` (vLLM's): requests share cached prefix pages only with requests of the same salt.
        `priority` (vLLM's): under the priority policy, lower is served first; else it must be 0.
        `grammar`: `params.structured_outputs` compiled already (the server compiles off this thread);
        compiled here when not given. `checked`: the caller ran `self.limits.check` and `check_cache_salt`
        on these token ids and values (the server does, to answer a 400 before it streams); else they run
        here. Either way, once."""
        if request_id in self.outputs:
            raise ValueError(f"request id {request_id!r} is already in use")
        truncate = params.truncate_prompt_tokens  # (the server cuts the prompt itself and leaves this None)
        if truncate is not None:
            self.limits.check_truncation(truncate)
        if isinstance(prompt, str):
            prompt_text: str | None = prompt
            prompt_token_ids = (encode_text(self.tokenizer, prompt, keep_last=self.limits.kept_tokens(truncate))
                                if prompt else [])
        else:
            prompt_text, prompt_token_ids = None, self.limits.truncate([int(t) for t in prompt], truncate)
        served = self.lora_modules.get(lora_name) if lora_name is not None else None
        if lora_name is not None and served is None:
            raise InvalidParam(f"The model `{lora_name}` does not exist: no LoRA adapter of that name", "model")
        if not checked:  # InvalidParam (a ValueError) for what cannot be served
            self.limits.check(prompt_token_ids, params, pooled=self.info.runner == "pooling")
            check_cache_salt(cache_salt)
            check_priority(priority, self.info.scheduling_policy)
        if self.info.runner == "pooling" and (params.max_tokens != 1 or params.n != 1 or params.structured_outputs):
            raise InvalidParam("this engine embeds prompts (--runner pooling): a request generates nothing, so "
                               "it has n=1 and max_tokens=1 (POOLING_PARAMS)", "max_tokens")
        if params.structured_outputs is not None and grammar is None:
            grammar = self.grammars.compile(params.structured_outputs)
        # The first sequence computes prompt logprobs (they are the request's); the others may read its
        # prompt from the prefix cache.
        sibling_params = params if params.prompt_logprobs is None else dataclasses.replace(params, prompt_logprobs=None)
        bad_words = bad_words_token_ids(self.tokenizer, params.bad_words)
        arrival_time = time.monotonic()
        serial = next(self._serials)
        sequences = []
        for index in range(params.n):
            seed = self._seed_rng.integers(2**32) if params.seed is None else params.seed + index
            sequences.append(Request(
                request_id=f"{request_id}#{index}/{serial}",
                prompt_token_ids=prompt_token_ids,
                sampling_params=params if index == 0 else sibling_params,
                eos_token_ids=self.info.eos_token_ids,
                max_model_len=self.max_model_len,
                sampling_seed=int(seed) % 2**32,
                arrival_time=arrival_time,
                cache_salt=cache_salt,
                priority=priority,
                lora_id=served[1] if served is not None else None,
                bad_words_token_ids=bad_words,
            ))
        detokenizers = [IncrementalDetokenizer.for_prompt(self.tokenizer, prompt_token_ids, params)
                        for _ in sequences]
        self._core.add_sequences(sequences, grammar)  # raises if the cache cannot hold them
        self.outputs.add(request_id, prompt_text, prompt_token_ids, params, [s.request_id for s in sequences],
                         detokenizers, arrival_time)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Drops requests wherever they are; their pages are free when this returns (in-process core) or
        by the core's next step (core process)."""
        seq_ids = []
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            seq_ids += self.outputs.abort(request_id)
        if seq_ids:
            self._core.finish(seq_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.outputs.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Runs a step of the core (in-process) or reads the core's latest steps (core process) and reports
        every request that made progress.

        A fault caused by one request's data fails that request alone (its output carries `error`); any
        other exception (the device, the runtime, the core's process gone) propagates: the engine cannot
        vouch for its state.
        """
        if self.core is None and not self.outputs.has_unfinished():
            return []  # the core process sends steps only while it has work: nothing to wait for
        processed = self.outputs.process(self._core.step())
        if processed.stopped:
            self._core.finish(processed.stopped, RequestStatus.FINISHED_STOPPED)
        if processed.dropped:
            self._core.finish(processed.dropped, RequestStatus.FINISHED_ABORTED)
        if self.core is not None and not self.outputs.has_unfinished() and self.core.has_unfinished():
            # The last requests ended here (a stop string, a failure) with a step in flight (async
            # scheduling): read it now, so an idle engine holds no step and no pages being filled.
            self.outputs.process(self.core.step())
        return processed.outputs
