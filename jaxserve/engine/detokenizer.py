"""Incremental detokenization and stop strings (pure Python, no jax).

Decoding token by token breaks multi-byte characters and merged pieces. The Rust tokenizer's
`DecodeStream` (what `tokenizers` offers for this) keeps a window of recent tokens and yields text once it
is whole; it starts from the prompt's last tokens, so the first generated tokens decode with their
spacing. One call per token, about 2 us, against 15 us for decoding a window twice through
transformers: at 256 sequences that is most of a step's host time. Text that could be the start of a
stop string is held back from the stream until it is known not to be one.
"""

from dataclasses import dataclass, field
from typing import Any

from tokenizers.decoders import DecodeStream

from jaxserve.sampling_params import SamplingParams

_PREFIX_WINDOW = 5  # prompt tokens of context so the first generated tokens decode with their spacing


@dataclass
class IncrementalDetokenizer:
    backend: Any  # the fast tokenizer's Rust `tokenizers.Tokenizer`
    params: SamplingParams
    stream: DecodeStream | None  # None: the request asked for no text (detokenize=False)
    text: str = ""
    num_emitted_chars: int = 0
    num_tokens: int = 0  # generated tokens added
    stop_reason: str | None = None
    _max_stop_len: int = field(init=False)

    def __post_init__(self) -> None:
        self._max_stop_len = max((len(s) for s in self.params.stop_strings), default=0)

    @classmethod
    def for_prompt(
        cls, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams
    ) -> "IncrementalDetokenizer":
        """`tokenizer`: a transformers fast tokenizer (every tokenizer jaxserve loads is one)."""
        if not params.detokenize:
            return cls(tokenizer.backend_tokenizer, params, None)
        context = list(prompt_token_ids[-_PREFIX_WINDOW:])
        stream = DecodeStream(ids=context, skip_special_tokens=params.skip_special_tokens)
        return cls(tokenizer.backend_tokenizer, params, stream)

    def add_tokens(self, new_token_ids: list[int]) -> bool:
        """Appends generated tokens to the text; True if a stop string ended the sequence."""
        return any(self.add_token(token_id) for token_id in new_token_ids)

    def add_token(self, token_id: int) -> bool:
        """Appends one generated token to the text; True if a stop string ended the sequence. Stop strings
        count from the token after the first min_tokens (vLLM's rule), and only those that end in text
        from there on."""
        self.num_tokens += 1
        if self.stream is None:
            return False
        piece = self.stream.step(self.backend, token_id)
        if not piece:  # an incomplete character: wait for the next token
            return False
        old_len = len(self.text)
        self.text += piece
        return bool(self._max_stop_len) and self.num_tokens > self.params.min_tokens and self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> bool:
        search_from = max(0, old_len - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.params.stop_strings:
            at = self.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        self.text = self.text[: at + len(stop)] if self.params.include_stop_str_in_output else self.text[:at]
        self.stop_reason = stop
        return True

    def take_delta(self, finished: bool) -> str:
        """The text not yet streamed, holding back a possible stop-string prefix unless finished."""
        end = len(self.text)
        if not finished and self._max_stop_len:
            end = max(self.num_emitted_chars, end - self._max_stop_len + 1)
        delta = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return delta
