"""Structured outputs with llguidance: grammars compiled from request fields, one matcher per sequence,
and the token bitmasks the step applies on the device (pure Python and numpy, no jax).

Threads: `GrammarCompiler.compile` may run on any thread (the API compiles on its grammar thread so
that a slow schema neither blocks the event loop nor the engine; the offline engine compiles inline).
llguidance releases the GIL while it builds a grammar. The compiler's tokenizer is built once, under a
lock, on first use (about 0.4 s for a 49k vocabulary), and shared: llguidance's tokenizer is immutable.
A `GrammarMatcher` belongs to one sequence and is used only by the engine thread after it is created.
"""

import collections
import json
import threading
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask, fill_next_token_bitmask_par

from jaxserve.sampling_params import InvalidParam, StructuredOutputsParams

# JSON as json.dumps writes it: no whitespace to loop on. `whitespace_pattern` or a schema's own
# "x-guidance" options (llguidance reads them between these defaults and nothing else) allow more.
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Resource limits for building a grammar and for each mask, so a hostile schema fails fast instead of
# stalling a step (llguidance's defaults, with verbose errors off: they would echo grammar internals).
_LIMITS = dict(verbose_errors=False)
_CACHE_SIZE = 256


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for a request's structured output. Raises InvalidParam for a definition
    that cannot be read (a schema that is not JSON, a grammar in neither Lark nor GBNF)."""
    try:
        if spec.json is not None or spec.json_object:
            schema = {"type": "object"} if spec.json_object else spec.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise InvalidParam("a JSON schema must be an object", "structured_outputs")
            options = dict(_COMPACT_JSON)
            if spec.whitespace_pattern is not None:
                options.update(whitespace_flexible=True, whitespace_pattern=spec.whitespace_pattern,
                               item_separator=",", key_separator=":")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if spec.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(choice) for choice in spec.choice))
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark
    except InvalidParam:
        raise
    except (ValueError, TypeError, RecursionError) as e:
        raise InvalidParam(f"the structured output's definition is invalid: {e}", "structured_outputs") from None


class GrammarMatcher:
    """One sequence's position in its grammar: which tokens may come next, and what has come.

    With `after_token_ids`, the grammar waits: tokens pass freely until the output has produced that
    sequence (a reasoning model's `</think>`), and the grammar applies from the next token on."""

    def __init__(self, matcher: llguidance.LLMatcher, after_token_ids: tuple[int, ...] = ()) -> None:
        self._matcher = matcher
        self._awaited = tuple(after_token_ids)
        self._recent: tuple[int, ...] = ()  # the output's last tokens while the grammar waits
        self._dead_end = False  # a mask found no token to continue the output (`consume`)

    @property
    def is_active(self) -> bool:
        """The grammar decides the next token (it no longer waits)."""
        return not self._awaited

    def consume(self, token_id: int) -> bool:
        """Advances past a sampled token; False if the grammar forbids it (the matcher is then in error), or
        if the last mask found no token that continues the output: llguidance then allows EOS alone, and
        accepts it, though the output is incomplete (a JSON schema whose required property refers to itself)."""
        if self._awaited:
            self._recent = (*self._recent, token_id)[-len(self._awaited):]
            if self._recent == self._awaited:
                self._awaited = ()
            return True
        if self._matcher.is_error():
            self._dead_end = True
            return False
        return self._matcher.consume_token(token_id)

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete: nothing but EOS may follow."""
        return self.is_active and self._matcher.is_stopped()

    @property
    def error(self) -> str:
        if self._dead_end:  # llguidance says NoExtensionBias
            return "no token can continue the output here"
        return self._matcher.get_error()

    def fork(self) -> "GrammarMatcher":
        forked = GrammarMatcher(self._matcher.deep_copy(), self._awaited)
        forked._recent = self._recent
        return forked

    @property
    def llmatcher(self) -> llguidance.LLMatcher:
        return self._matcher


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar checked against the tokenizer; `matcher()` starts a sequence on it."""

    _template: llguidance.LLMatcher

    def matcher(self, after_token_ids: tuple[int, ...] = ()) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), after_token_ids)


class GrammarCompiler:
    """Compiles structured-output definitions for one tokenizer, with an LRU of compiled grammars."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size  # the logits width: masks cover it, tokens past the tokenizer are banned
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, CompiledGrammar] = collections.OrderedDict()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf  # 0.7 s of imports (transformers' tokenizer classes): paid on first use

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_token_ids or None)
            return self._tokenizer

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Raises InvalidParam (a 400 for the API) for a definition llguidance rejects."""
        key = spec.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        grammar = grammar_text(spec)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0,
                                       limits=llguidance.LLParserLimits(**_LIMITS))
        if matcher.is_error():
            raise InvalidParam(f"the structured output's definition is invalid: {matcher.get_error()}",
                               "structured_outputs")
        first = matcher.deep_copy()  # its first mask: a definition that no output matches has no first token
        fill_next_token_bitmask(first, allocate_token_bitmask(1, self.vocab_size), 0)
        if first.is_error():
            raise InvalidParam("the structured output's definition matches no output", "structured_outputs")
        compiled = CompiledGrammar(matcher)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


class MaskFiller:
    """Fills the step's token bitmask rows from the sequences' matchers, in parallel in llguidance."""

    def __init__(self) -> None:
        self._executor = llguidance.LLExecutor()

    def fill(self, rows: list[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        """bitmask: i32[R, W], C-contiguous; each listed row gets its matcher's next-token mask."""
        if rows:
            fill_next_token_bitmask_par(self._executor, [(m.llmatcher, row) for m, row in rows], bitmask)


def allowed_tokens(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a bitmask row allows (for tests and checks): i32[W] -> i64[K]."""
    bits = (bitmask_row.astype(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1  # [W, 32]
    return np.flatnonzero(bits.reshape(-1)[:vocab_size])
