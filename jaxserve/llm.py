"""`jaxserve.LLM`: offline batched generation, like `vllm.LLM`."""

import argparse
import dataclasses
import itertools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from jaxserve.cli_flags import ENGINE_FLAGS, INERT_ENGINE_FLAGS
from jaxserve.config import (
    CHAT_TEMPLATE_CONTENT_FORMATS,
    EngineConfig,
    LoraModule,
    LoRARequest,
    check_generation_overrides,
    engine_preset,
    profiler_dir,
)
from jaxserve.engine.beam_search import Beam, BeamSearch, check_search
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.scoring import check_pairing, class_probabilities, cosine_scores
from jaxserve.models.source import load_generation_defaults
from jaxserve.models.tokenizer import apply_chat_template, encode_text
from jaxserve.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
    RequestOutputKind,
    ScoringOutput,
    ScoringRequestOutput,
)
from jaxserve.platform import prepare_jax_platform
from jaxserve.sampling_params import POOLING_PARAMS, BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict[str, Any]  # text, token ids, or {"prompt_token_ids": [...]}
Conversation = list[dict[str, Any]]


class LLM:
    """Loads a model once and generates for many prompts at a time.

    `LLM()` uses the bundled SmolLM2-135M-Instruct. Keyword arguments are engine options
    (`max_model_len`, `max_num_seqs`, `num_kv_pages`, `enforce_eager`, ...), and vLLM's that change nothing
    here (`trust_remote_code`, `swap_space`, ...: serve's inert flags) are taken with a warning; `config`
    names a preset in jaxserve/configs/ or a YAML file.
    `generation_config` and `override_generation_config` are serve's flags of those names (vLLM's): the
    sampling parameters that `generate` and `chat` use when given none (`get_default_sampling_params`).
    """

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        config: str | None = None,
        generation_config: str = "auto",
        override_generation_config: dict[str, Any] | None = None,
        **engine_options: Any,
    ) -> None:
        prepare_jax_platform()  # before anything starts jax's backends, as the CLI does
        if override_generation_config is not None:
            check_generation_overrides(override_generation_config)  # before the model loads
        for flag in INERT_ENGINE_FLAGS:  # vLLM's options that change nothing here, as the CLI takes them
            if flag.option in engine_options:
                value = engine_options.pop(flag.option)
                if flag.check is not None:
                    try:
                        flag.check(str(value))
                    except argparse.ArgumentTypeError as error:
                        raise ValueError(f"{flag.option}: {error}") from None
                logger.warning("%s=%r changes nothing in jaxserve: %s", flag.option, value, flag.why)
        engine_options = _by_field_name(engine_options)
        # serve's preset where `config` is None: the platform's (vLLM's LLM and serve share their defaults)
        preset = engine_preset(config, engine_options.get("gpu_memory_utilization"),
                               bool(engine_options.get("engine_process")), engine_options.get("data_parallel_size"))
        engine_config = EngineConfig.from_preset(preset, model=model, dtype=dtype, **engine_options)
        self._start(LLMEngine(engine_config), generation_config, override_generation_config)

    @classmethod
    def from_engine_config(cls, engine_config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm._start(LLMEngine(engine_config))
        return llm

    def _start(self, engine: LLMEngine, generation_config: str = "auto",
               override_generation_config: dict[str, Any] | None = None) -> None:
        self.engine = engine
        self._ids = itertools.count()
        model_dir = engine.info.model_dir
        self._generation_defaults = load_generation_defaults(
            generation_config, Path(model_dir) if model_dir else None, override_generation_config)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what `generate` and `chat` sample with when given no SamplingParams: the model's
        generation_config.json defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens
        as max_tokens) under `override_generation_config`, the rest SamplingParams' own."""
        return SamplingParams(**self._generation_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; outputs come back in prompt order. `priority`: one per prompt, under
        the priority scheduling policy (lower first). `lora_request`: the LoRA adapter to generate with, for
        every prompt or one per prompt (None: the base model), on an engine built with enable_lora=True."""
        return self._run([_prompt_input(p) for p in _as_prompts(prompts)], sampling_params, use_tqdm, priority,
                         lora_request)

    def embed(self, prompts: Prompt | Sequence[Prompt], truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (`outputs.embedding`, vLLM's form; not normalized) from an engine built
        with runner="pooling"; outputs in prompt order. `truncate_prompt_tokens` keeps each prompt's last
        tokens (-1: the context's worth), as `score`."""
        if self.engine.info.class_labels:
            raise ValueError("the model is a classifier: its outputs are class logits, not embeddings (classify, "
                             "score)")
        params = dataclasses.replace(POOLING_PARAMS, truncate_prompt_tokens=truncate_prompt_tokens)
        return [EmbeddingRequestOutput.of(o) for o in self._run([_prompt_input(p) for p in _as_prompts(prompts)],
                                                                params, use_tqdm)]

    def classify(self, prompts: Prompt | Sequence[Prompt], truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """vLLM's: each prompt's class probabilities (`outputs.probs`, through the model's activation:
        `classifier.class_activation`) from a classifier model (an architecture ending in
        ForSequenceClassification); outputs in prompt order."""
        if not self.engine.info.class_labels:
            raise ValueError("classify needs a classifier model (an architecture ending in ForSequenceClassification)")
        params = dataclasses.replace(POOLING_PARAMS, truncate_prompt_tokens=truncate_prompt_tokens)
        outputs = [EmbeddingRequestOutput.of(o) for o in self._run([_prompt_input(p) for p in _as_prompts(prompts)],
                                                                   params, use_tqdm)]
        activation = self.engine.info.class_activation
        probs = [class_probabilities(o.outputs.embedding, activation).tolist() for o in outputs]
        return [ClassificationRequestOutput(o.request_id, o.prompt_token_ids, ClassificationOutput(p))
                for o, p in zip(outputs, probs, strict=True)]

    def score(
        self,
        data_1: Prompt | Sequence[Prompt],
        data_2: Prompt | Sequence[Prompt],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's scoring with an embedding model (an engine built with runner="pooling"): the cosine
        similarity of each pair's embeddings, `data_1` against `data_2` one to one, or one text against each
        of `data_2`, as the server's /score (engine/scoring.py). `truncate_prompt_tokens` cuts every text; a list
        of `lora_request`s has one per text, data_1's then data_2's (vLLM's)."""
        firsts, seconds = _as_prompts(data_1), _as_prompts(data_2)
        check_pairing(len(firsts), len(seconds))
        params = dataclasses.replace(POOLING_PARAMS, truncate_prompt_tokens=truncate_prompt_tokens)
        if self.engine.info.class_labels:
            return self._cross_score(firsts, seconds, params, use_tqdm)
        embedded = self._run([_prompt_input(p) for p in firsts + seconds], params, use_tqdm,
                             lora_request=lora_request)
        pooled = [EmbeddingRequestOutput.of(output) for output in embedded]
        lefts, rights = pooled[:len(firsts)], pooled[len(firsts):]
        scores = cosine_scores([o.outputs.embedding for o in lefts], [o.outputs.embedding for o in rights])
        lefts = lefts * len(rights) if len(lefts) == 1 else lefts
        return [ScoringRequestOutput(f"{left.request_id}_{right.request_id}", ScoringOutput(score),
                                     left.prompt_token_ids + right.prompt_token_ids)
                for left, right, score in zip(lefts, rights, scores, strict=True)]

    def _cross_score(self, firsts: list[Prompt], seconds: list[Prompt], params: SamplingParams,
                     use_tqdm: bool) -> list[ScoringRequestOutput]:
        """`score` with a cross-encoder (a classifier with one class): each pair one prompt, the tokenizer's pair
        encoding of the two texts, scored by the sigmoid of its class logit (the server's /score)."""
        if len(self.engine.info.class_labels) != 1:
            raise ValueError("score needs an embedding model or a cross-encoder (a classifier with one class)")
        if not all(isinstance(text, str) for text in firsts + seconds):
            raise ValueError("a cross-encoder scores pairs of texts (strings)")
        pairs = [(firsts[0], second) for second in seconds] if len(firsts) == 1 else list(zip(firsts, seconds,
                                                                                                strict=True))
        tokenizer, limits, truncate = self.engine.tokenizer, self.engine.limits, params.truncate_prompt_tokens
        limits.check_truncation(truncate)
        prompts = [encode_text(tokenizer, first, second, keep_last=limits.kept_tokens(truncate))
                   for first, second in pairs]  # cut here, inside the pair's special tokens
        params = dataclasses.replace(params, truncate_prompt_tokens=None)
        outputs = [EmbeddingRequestOutput.of(o) for o in self._run(prompts, params, use_tqdm)]
        activation = self.engine.info.score_activation
        scores = [float(class_probabilities(o.outputs.embedding, activation)[0]) for o in outputs]
        return [ScoringRequestOutput(o.request_id, ScoringOutput(score), o.prompt_token_ids)
                for o, score in zip(outputs, scores, strict=True)]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generates the assistant's reply to one conversation or to each of a list of them, vLLM's
        arguments in vLLM's order: the LoRA adapter of `lora_request` as `generate`; the template rendered
        as the chat API renders a request (`tools`, `chat_template_kwargs`, `continue_final_message`, and
        content given as OpenAI's text parts)."""
        if chat_template_content_format not in CHAT_TEMPLATE_CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of "
                             f"{', '.join(CHAT_TEMPLATE_CONTENT_FORMATS)}, got {chat_template_content_format!r}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts = [
            apply_chat_template(tokenizer, conv, chat_template, add_generation_prompt,
                                continue_final_message=continue_final_message, tools=tools,
                                chat_template_kwargs=chat_template_kwargs,
                                content_format=chat_template_content_format)
            for conv in conversations
        ]
        return self._run(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (engine/beam_search.py) for each prompt, best beams first, in prompt order.
        Each round asks the engine for one token after every live beam of every prompt at once, with its
        2 x beam_width alternatives (so beam_width is at most half of max_logprobs); the prefix cache serves
        the beams' shared tokens. `concurrency_limit`: prompts searched at a time (all of them: None)."""
        if concurrency_limit is not None and (type(concurrency_limit) is not int or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be a positive integer, got {concurrency_limit!r}")
        check_search(params.beam_width, params.length_penalty, self.engine.limits.max_logprobs,
                     self.engine.max_model_len)
        tokenizer = self.engine.tokenizer
        prompt_ids = [p if isinstance(p, list) else tokenizer.encode(p) if p else []
                      for p in map(_prompt_input, _as_prompts(prompts))]
        for ids in prompt_ids:  # each round's prompt grows by a token, its last the generated one
            if len(ids) + params.max_tokens > self.engine.max_model_len:
                raise ValueError(f"a prompt of {len(ids)} tokens and max_tokens {params.max_tokens} exceed the "
                                 f"model's context of {self.engine.max_model_len} tokens")
        lora_requests = self._lora_requests(lora_request, len(prompt_ids))
        eos = frozenset(() if params.ignore_eos else self.engine.info.eos_token_ids)
        step = SamplingParams(n=1, temperature=0.0, max_tokens=1, logprobs=2 * params.beam_width, ignore_eos=True)
        limit = concurrency_limit or max(len(prompt_ids), 1)
        outputs = []
        with tqdm(total=len(prompt_ids), desc="Beam search", disable=not use_tqdm, leave=False) as bar:
            for start in range(0, len(prompt_ids), limit):
                group = range(start, min(start + limit, len(prompt_ids)))
                searches = {i: BeamSearch(len(prompt_ids[i]), params.beam_width, params.max_tokens, eos,
                                          params.length_penalty) for i in group}
                while live := [(i, s) for i, s in searches.items() if not s.done]:
                    asked = [(i, beam) for i, search in live for beam in search.live_token_ids()]
                    finals = self._run([[*prompt_ids[i], *beam] for i, beam in asked], step, use_tqdm=False,
                                       lora_request=[lora_requests[i] for i, _ in asked], decode_logprob_tokens=False)
                    answers = iter(final.outputs[0].top_logprobs[0] for final in finals)
                    for _, search in live:
                        search.extend([next(answers) for _ in search.live])
                for i in group:
                    outputs.append(BeamSearchOutput([self._beam_sequence(prompt_ids[i], beam, lora_requests[i])
                                                     for beam in searches[i].best()]))
                    bar.update(1)
        return outputs

    def _beam_sequence(self, prompt_ids: list[int], beam: Beam, lora_request: LoRARequest | None) -> BeamSearchSequence:
        """vLLM's record of a beam: the prompt's tokens and the beam's, all of them decoded."""
        tokens = [*prompt_ids, *beam.token_ids]
        decoded = self._decoded({t for alternatives in beam.alternatives for t in alternatives})
        ranked = [{t: Logprob(logprob, rank, decoded[t]) for rank, (t, logprob) in enumerate(alternatives.items(), 1)}
                  for alternatives in beam.alternatives]
        return BeamSearchSequence(tokens, ranked, beam.cumulative_logprob, self.engine.tokenizer.decode(tokens),
                                  "stop" if beam.finished else "length",
                                  beam.token_ids[-1] if beam.finished else None, lora_request)

    def start_profile(self, profile_dir: str | None = None) -> None:
        """vLLM's: records a `jax.profiler` trace of the engine's steps until `stop_profile` (XProf /
        TensorBoard and Perfetto files) into `profile_dir`, else $JAXSERVE_PROFILER_DIR, else
        $VLLM_TORCH_PROFILER_DIR."""
        log_dir = profiler_dir(profile_dir)
        if log_dir is None:
            raise ValueError("start_profile needs a folder: profile_dir, $JAXSERVE_PROFILER_DIR or "
                             "$VLLM_TORCH_PROFILER_DIR")
        self.engine.start_profile(log_dir)

    def stop_profile(self) -> str:
        """Ends the trace once the device has run every step launched; returns the folder it went to."""
        return self.engine.stop_profile()

    def _lora_requests(self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                       num_prompts: int) -> list[LoRARequest | None]:
        requests = [lora_request] * num_prompts if lora_request is None or isinstance(lora_request, LoRARequest) \
            else list(lora_request)
        if len(requests) != num_prompts:
            raise ValueError(f"{num_prompts} prompts but {len(requests)} LoRA requests")
        return requests

    def _lora_names(self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                    num_prompts: int) -> list[str | None]:
        """Each prompt's adapter name, its adapter loaded on first use (the same name must keep its path)."""
        requests = self._lora_requests(lora_request, num_prompts)
        for request in {r for r in requests if r is not None}:
            served = self.engine.lora_modules.get(request.lora_name)
            if served is None:
                self.engine.load_lora(LoraModule(request.lora_name, request.lora_path))
            elif served[0].path != request.lora_path:
                raise ValueError(f"LoRA adapter {request.lora_name!r} is loaded from {served[0].path}, not "
                                 f"{request.lora_path}")
        return [r.lora_name if r is not None else None for r in requests]

    def _run(
        self,
        prompts: list[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        decode_logprob_tokens: bool = True,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priority)} priorities")
        lora_names = self._lora_names(lora_request, len(prompts))
        # Only the finished outputs are returned: the engine builds no others (vLLM's LLM does the same).
        sampling_params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in sampling_params]
        request_ids = [str(next(self._ids)) for _ in prompts]
        added: list[str] = []
        try:
            for request_id, prompt, params, rank, lora_name in zip(request_ids, prompts, sampling_params, priority,
                                                                   lora_names, strict=True):
                self.engine.add_request(request_id, prompt, params, priority=rank, lora_name=lora_name)
                added.append(request_id)
        except ValueError:
            self.engine.abort_request(added)  # all or nothing
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm, leave=False) as bar:
            while len(finished) < len(request_ids):
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        outputs = [finished[request_id] for request_id in request_ids]
        for output, params in zip(outputs, sampling_params, strict=True):
            if decode_logprob_tokens and params.detokenize:  # detokenize=False: nothing decoded
                self._decode_logprob_tokens(output)
        return outputs

    def _decode_logprob_tokens(self, output: RequestOutput) -> None:
        """vLLM's Logprob.decoded_token, each logprob's token decoded alone, for an output that has logprobs."""
        ids = {t for entry in output.prompt_logprobs or [] if entry for t in entry}
        for completion in output.outputs:
            if completion.token_logprobs is not None:
                ids.update(completion.token_ids)
                ids.update(t for top in completion.top_logprobs or [] for t in top)
        if not ids:
            return
        decoded = self._decoded(ids)
        for completion in output.outputs:
            if completion.token_logprobs is not None:
                completion.decoded_tokens = decoded
        if output.prompt_logprobs is not None:
            output.prompt_logprobs = [None if entry is None else
                                      {t: lp._replace(decoded_token=decoded[t]) for t, lp in entry.items()}
                                      for entry in output.prompt_logprobs]

    def _decoded(self, token_ids: set[int]) -> dict[int, str]:
        tokenizer = self.engine.tokenizer
        return {t: tokenizer.decode([t]) for t in token_ids}


def _by_field_name(options: dict[str, Any]) -> dict[str, Any]:
    """`options` with vLLM's names of engine options that jaxserve's fields name otherwise (block_size,
    num_gpu_blocks_override, task: the serve flags' own names) under the field's name, a text converted
    as the flag converts it (task="embed" is runner="pooling")."""
    aliases = {name[2:].replace("-", "_"): flag for flag in ENGINE_FLAGS for name in flag.names
               if name.startswith("--") and name[2:].replace("-", "_") != flag.field}
    result = dict(options)
    for name, flag in aliases.items():
        if name not in result:
            continue
        value = result.pop(name)
        convert = flag.options.get("type")
        if isinstance(value, str) and convert is not None:
            try:
                value = convert(value)
            except argparse.ArgumentTypeError as error:
                raise ValueError(f"{name}: {error}") from None
        if result.get(flag.field, value) != value:
            raise ValueError(f"{name}={value!r} and {flag.field}={result[flag.field]!r} set the same option")
        result[flag.field] = value
    return result


def _as_prompts(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a text, token ids, a dict) as a list of one; a list of prompts as it is."""
    if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _prompt_input(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return prompt["prompt"]
    return prompt
