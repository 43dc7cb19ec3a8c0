"""SamplingParams: how one request samples and when it stops (pure Python, no jax).

This module holds the one rule for what a request may ask: `SamplingParams` checks every field against
its documented range (OpenAI's for OpenAI's fields, vLLM's for its extras) and against what the step's
device arrays can hold; `RequestLimits.check` adds what depends on the loaded engine (vocabulary,
context length, KV capacity, compiled logprob width). The API calls both before it queues a request and
the engine calls them again when it adds one, so nothing the engine thread builds can overflow.
"""

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from jaxserve.outputs import RequestOutputKind

_GREEDY_EPS = 1e-5
MAX_N = 128  # OpenAI's limit on choices per request
MAX_STOP_STRINGS = 64  # each generated token is checked against every stop string
MAX_STOP_STRING_CHARS = 1024
_INT32_MAX = 2**31 - 1
_MIN_REPETITION_PENALTY = 0.01  # dividing a float32 logit by less could overflow it to inf


MAX_BAD_WORDS = 32  # each bans up to two tokens a step (with and without a leading space)
MAX_GRAMMAR_CHARS = 256 * 1024  # a schema, regex or grammar's text; larger ones are refused before compiling
MAX_CHOICES = 1024


class InvalidParam(ValueError):
    """A request field out of its range; `param` names the field, as OpenAI's error envelope does."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidParam(f"{name} must be an integer in [{low}, {high}], got {value!r}", name)


def _check_float(name: str, value: object, low: float, high: float, *, open_low: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (low < value if open_low else low <= value) and value <= high
    if not ok:
        bracket = "(" if open_low else "["
        raise InvalidParam(f"{name} must be a finite number in {bracket}{low}, {high}], got {value!r}", name)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's `structured_outputs`): exactly one of a JSON schema (a dict or
    its JSON text), any JSON object, a regular expression, one of several strings, or a Lark / EBNF
    grammar. JSON is compact (json.dumps' separators) unless `whitespace_pattern` allows more, so a
    model cannot spend its tokens on whitespace."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace_pattern: str | None = None  # a regex for the whitespace between JSON tokens
    # The grammar applies once the output has produced these tokens (a reasoning model's end of
    # thinking, `</think>`): what comes before is free. Not part of the grammar's definition (`key`).
    after_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise InvalidParam("structured outputs need exactly one of json, json_object, regex, choice or grammar; "
                               f"got {', '.join(given) or 'none'}", "structured_outputs")
        if not isinstance(self.json_object, bool):
            raise InvalidParam("structured_outputs.json_object must be a boolean", "structured_outputs")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise InvalidParam("a JSON schema must be an object", "structured_outputs")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidParam(f"structured_outputs.{name} must be a non-empty string", "structured_outputs")
        if self.choice is not None:
            ok = isinstance(self.choice, list) and 0 < len(self.choice) <= MAX_CHOICES
            if not ok or not all(isinstance(c, str) and c for c in self.choice):
                raise InvalidParam(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings",
                                   "structured_outputs")
        if len(self.key) > MAX_GRAMMAR_CHARS:
            raise InvalidParam(f"the structured output's definition exceeds {MAX_GRAMMAR_CHARS} characters",
                               "structured_outputs")

    @property
    def key(self) -> str:
        """A canonical text of the definition: equal definitions share a compiled grammar."""
        return json.dumps({k: v for k, v in self.__dict__.items() if v not in (None, False) and k != "after_token_ids"},
                          sort_keys=True)


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings, named and defaulted as in vLLM / the OpenAI API.

    `temperature == 0` means greedy. `top_k <= 0` (or -1) disables top-k. `seed` makes sampling
    reproducible whatever else shares the batch. Validation raises InvalidParam (a ValueError) with a
    message fit for an API user.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # top alternatives per token (0: only the sampled token's logprob)
    prompt_logprobs: int | None = None  # the same for each prompt token (vLLM's); the prompt is computed
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None  # vLLM's: none of these words' token sequences is completed
    structured_outputs: StructuredOutputsParams | None = None  # constrains every token to a grammar
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # what each of its outputs holds
    # vLLM's: the only tokens the output may hold, EOS and stop ids included (a list without EOS runs to
    # max_tokens); a mask on the logits, with a structured output's if both are given
    allowed_token_ids: tuple[int, ...] | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: the prompt's last k tokens kept (-1: max_model_len)
    detokenize: bool = True  # vLLM's: False leaves the text empty (token ids only) and skips decoding
    # vLLM's: spaces between special tokens kept in the text (with skip_special_tokens=False); taken, and
    # changes nothing here: special tokens are decoded as the tokenizer writes them
    spaces_between_special_tokens: bool = True
    extra_args: dict[str, Any] | None = None  # vLLM's: carried for custom code, read by nothing in jaxserve
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = (self.stop,)
        else:
            self.stop_strings = tuple(self.stop or ())
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self.bad_words = list(self.bad_words or [])
        if self.top_k is None or (isinstance(self.top_k, int) and -1 <= self.top_k < 0):
            self.top_k = 0
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list | tuple) or not ids or not all(
                    type(t) is int and 0 <= t < _INT32_MAX for t in ids):
                raise InvalidParam("allowed_token_ids must be a non-empty list of token ids", "allowed_token_ids")
            self.allowed_token_ids = tuple(ids)
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n, 1, MAX_N)
        _check_float("temperature", self.temperature, 0.0, 2.0)
        _check_float("top_p", self.top_p, 0.0, 1.0, open_low=True)
        _check_int("top_k", self.top_k, 0, _INT32_MAX)  # -1 (off) became 0 above
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63), 2**64 - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, _INT32_MAX)
        _check_int("min_tokens", self.min_tokens, 0, _INT32_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParam(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
                               "min_tokens")
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise InvalidParam(f"at most {MAX_STOP_STRINGS} stop strings are supported", "stop")
        for stop in self.stop_strings:
            if not isinstance(stop, str) or not 0 < len(stop) <= MAX_STOP_STRING_CHARS:
                raise InvalidParam(f"stop strings must be 1 to {MAX_STOP_STRING_CHARS} characters", "stop")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, 0, _INT32_MAX)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, _INT32_MAX)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, _MIN_REPETITION_PENALTY, 2.0)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParam(f"{name} must be true or false, got {getattr(self, name)!r}", name)
        if not self.detokenize and self.stop_strings:
            raise InvalidParam("stop strings are found in the text: they need detokenize=True", "stop")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise InvalidParam("extra_args must be a dict", "extra_args")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidParam("structured_outputs must be a StructuredOutputsParams", "structured_outputs")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise InvalidParam("output_kind must be a RequestOutputKind", "output_kind")
        if len(self.bad_words) > MAX_BAD_WORDS or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise InvalidParam(f"bad_words must be at most {MAX_BAD_WORDS} non-blank strings", "bad_words")
        for token_id, bias in self.logit_bias.items():
            _check_int("logit_bias", token_id, 0, _INT32_MAX)
            _check_float("logit_bias", bias, -100.0, 100.0)

    @property
    def has_penalties(self) -> bool:
        """Whether sampling depends on the tokens seen so far (so the runner keeps counts)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def fills_batch_rows(self) -> bool:
        """Whether the runner fills this request's batch row itself every step (penalty rows, logit_bias,
        min_tokens' and bad words' bans, prompt logprobs, allowed_token_ids' mask) rather than only gathering
        its persistent row."""
        return (self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0 or self.prompt_logprobs is not None
                or bool(self.bad_words) or self.allowed_token_ids is not None)

    @property
    def is_greedy(self) -> bool:
        """The one definition of greedy; its row's temperature is then GREEDY_TEMPERATURE exactly."""
        return self.temperature < _GREEDY_EPS


GREEDY_TEMPERATURE = 0.0  # a sampling row's temperature when its request is greedy (the sampler's test)


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's parameters of `LLM.beam_search`: `beam_width` beams kept each round, up to `max_tokens` generated,
    ranked by cumulative logprob / length ** `length_penalty`; `ignore_eos`: no beam ends at an EOS;
    `include_stop_str_in_output`: a finished beam's EOS stays in its token ids (the server's choices;
    `LLM.beam_search`'s records keep it, as vLLM's do). Beams
    are ranked by the model's raw logprobs, as vLLM's V1 engine ranks them, so `temperature` changes nothing."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, 1, _INT32_MAX)
        _check_int("max_tokens", self.max_tokens, 1, _INT32_MAX)
        _check_float("temperature", self.temperature, 0.0, 2.0)
        _check_float("length_penalty", self.length_penalty, -math.inf, math.inf)


class RowField(NamedTuple):
    """One per-request sampling value as the step reads it: its column's name (as in the runner's rows and
    `SamplingArrays`), dtype, the value that switches it off (a padding row), and how it is read."""

    name: str
    dtype: str  # a numpy dtype name
    neutral: float | int | bool
    read: Callable[[SamplingParams], float | int | bool]


# The one table of sampling rows: the runner's persistent rows, a new request's values (`sampling_row`),
# the step's per-row sampling arrays and the neutral batch all come from it.
SAMPLING_ROW: tuple[RowField, ...] = (
    RowField("temperature", "float32", GREEDY_TEMPERATURE,
             lambda p: GREEDY_TEMPERATURE if p.is_greedy else p.temperature),
    RowField("top_k", "int32", 0, lambda p: p.top_k),  # 0 = off
    RowField("top_p", "float32", 1.0, lambda p: p.top_p),  # 1 = off
    RowField("min_p", "float32", 0.0, lambda p: p.min_p),  # 0 = off
    RowField("repetition_penalty", "float32", 1.0, lambda p: p.repetition_penalty),  # 1 = off
    RowField("frequency_penalty", "float32", 0.0, lambda p: p.frequency_penalty),  # 0 = off
    RowField("presence_penalty", "float32", 0.0, lambda p: p.presence_penalty),  # 0 = off
    RowField("wants_logprobs", "bool", False, lambda p: p.logprobs is not None),  # the sample's logprob
    RowField("wants_top_logprobs", "bool", False, lambda p: bool(p.logprobs)),  # and its alternatives
)


def sampling_row(params: SamplingParams) -> tuple:
    """A request's values of SAMPLING_ROW, in its order."""
    return tuple(column.read(params) for column in SAMPLING_ROW)


def check_cache_salt(salt: object) -> None:
    """vLLM's rule: a cache salt, when given, is a non-empty string."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidParam("cache_salt must be a non-empty string if provided", "cache_salt")


def check_priority(priority: object, scheduling_policy: str) -> None:
    """vLLM's rule: a request's priority is an int, and other than 0 only under the priority policy."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidParam("priority must be an integer", "priority")
    if priority != 0 and scheduling_policy != "priority":
        raise InvalidParam(f"priority {priority} was given but the server schedules {scheduling_policy}; "
                           "start it with --scheduling-policy priority", "priority")


def max_num_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, pooled: bool = False) -> int:
    """Prompt + output length at which a request must stop: what it may need of the KV cache. A `pooled`
    request (--runner pooling) stops at its one sample, which is dropped and takes no position, so its prompt
    may fill the context."""
    if pooled:
        return num_prompt_tokens + 1
    limit = max_model_len if max_tokens is None else num_prompt_tokens + max_tokens
    return min(limit, max_model_len)


def kv_tokens(max_num_tokens: int, pooled: bool) -> int:
    """The KV cache positions a request of up to `max_num_tokens` may fill: as many, but a pooled request's,
    whose one sample is dropped and takes no position."""
    return max_num_tokens - 1 if pooled else max_num_tokens


def fits_kv_cache(num_tokens: int, kv_capacity_tokens: int) -> bool:
    """The one rule for whether a request of up to `num_tokens` can ever run: its pages fit the cache
    (`kv_capacity_tokens`: usable pages x page size, so a whole number of pages)."""
    return num_tokens <= kv_capacity_tokens


@dataclass(frozen=True)
class RequestLimits:
    """What the loaded engine can serve, fixed at start-up: a plain record that the API thread may read
    while the engine thread steps."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int  # the compiled width of the top-logprobs output
    max_biased_tokens: int  # logit_bias + stop_token_ids + EOS entries per row of the step
    num_eos_tokens: int
    kv_capacity_tokens: int  # usable KV pages x page size

    def check(self, prompt_token_ids: list[int], params: SamplingParams, pooled: bool = False) -> None:
        """Raises InvalidParam for a request this engine cannot serve (`pooled`: a prompt to embed)."""
        num_prompt = len(prompt_token_ids)
        if not num_prompt:
            raise InvalidParam("the prompt is empty", "prompt")
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidParam(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", "prompt")
        self.check_length(num_prompt, params.max_tokens, pooled)
        if params.max_tokens is None and not pooled and params.min_tokens > self.max_model_len - num_prompt:
            raise InvalidParam(f"min_tokens ({params.min_tokens}) must be <= max_tokens (the "
                               f"{self.max_model_len - num_prompt} tokens the context leaves after the prompt)",
                               "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise InvalidParam(f"{name} must be at most {self.max_logprobs} (--max-logprobs), got {value}", name)
        bad = next((t for t in [*params.logit_bias, *params.stop_token_ids] if t >= self.vocab_size), None)
        if bad is not None:
            raise InvalidParam(f"token id {bad} in logit_bias/stop_token_ids is outside the vocabulary "
                               f"[0, {self.vocab_size})", "logit_bias" if bad in params.logit_bias else
                               "stop_token_ids")
        bad = next((t for t in params.allowed_token_ids or () if t >= self.vocab_size), None)
        if bad is not None:
            raise InvalidParam(f"token id {bad} in allowed_token_ids is outside the vocabulary [0, {self.vocab_size})",
                               "allowed_token_ids")
        num_biased = (len(params.logit_bias) + len(params.stop_token_ids) + self.num_eos_tokens
                      + 2 * len(params.bad_words))
        if num_biased > self.max_biased_tokens:
            counts = {"logit_bias": len(params.logit_bias), "stop_token_ids": len(params.stop_token_ids),
                      "bad_words": 2 * len(params.bad_words)}
            raise InvalidParam(f"logit_bias, stop_token_ids and bad_words name {num_biased} tokens together (with "
                               f"EOS); at most {self.max_biased_tokens} are supported",
                               max(counts, key=counts.__getitem__))  # the field that names the most

    def check_truncation(self, truncate: int | None) -> None:
        """vLLM's rule for truncate_prompt_tokens: -1 (the context length) or 1 to max_model_len."""
        if truncate is not None and (isinstance(truncate, bool) or not isinstance(truncate, int) or not (
                truncate == -1 or 1 <= truncate <= self.max_model_len)):
            raise InvalidParam(f"truncate_prompt_tokens must be -1 or in [1, {self.max_model_len}] (the maximum "
                               f"context length), got {truncate}", "truncate_prompt_tokens")

    def kept_tokens(self, truncate: int | None) -> int | None:
        """How many tokens truncate_prompt_tokens keeps (-1: the context length's worth); None: all."""
        return self.max_model_len if truncate == -1 else truncate

    def truncate(self, token_ids: list[int], truncate: int | None) -> list[int]:
        """The prompt's last `truncate` tokens (-1: the context length's worth); all of them for None. (A text's
        are cut as it is tokenized, its special tokens kept: `models.tokenizer.encode_text`.)"""
        if truncate is None:
            return token_ids
        return token_ids[-self.kept_tokens(truncate):]

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, pooled: bool = False) -> None:
        """OpenAI's context-length error, with the numbers that broke it; then the KV capacity. A `pooled`
        prompt (embedded: nothing generated) may fill the context."""
        if pooled:
            if num_prompt_tokens > self.max_model_len:
                raise InvalidParam(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                    f"{num_prompt_tokens} tokens in the input for embedding generation. Please reduce the length "
                    "of the input.", "prompt")
        elif max_tokens is None:  # up to the context length
            if num_prompt_tokens >= self.max_model_len:
                raise InvalidParam(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                    f"prompt has {num_prompt_tokens} tokens, which leaves no room for the completion. "
                    "Please reduce the length of the prompt.", "prompt")
        elif num_prompt_tokens + max_tokens > self.max_model_len:
            raise InvalidParam(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.", "max_tokens")
        total = kv_tokens(max_num_tokens(num_prompt_tokens, max_tokens, self.max_model_len, pooled), pooled)
        if not fits_kv_cache(total, self.kv_capacity_tokens):
            raise InvalidParam(f"the request needs up to {total} tokens of KV cache but the cache holds "
                               f"{self.kv_capacity_tokens}", "max_tokens")


# What an embedding request asks of a pooling engine: its prompt computed, one token sampled and dropped.
POOLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
