"""Incremental detokenization and stop strings (pure Python, no jax).

Decoding token by token breaks multi-byte characters and merged pieces, so each step decodes a short
window of recent tokens twice (with and without the new ones) and emits the difference once it no
longer ends in a replacement character. Text that could be the start of a stop string is held back
from the stream until it is known not to be one.
"""

from dataclasses import dataclass, field
from typing import Any

from jaxserve.sampling_params import SamplingParams

_PREFIX_WINDOW = 5  # prompt tokens of context so the first generated tokens decode with their spacing


@dataclass
class IncrementalDetokenizer:
    tokenizer: Any
    params: SamplingParams
    token_ids: list[int]  # context (tail of the prompt) followed by generated tokens
    prefix_offset: int
    read_offset: int
    text: str = ""
    num_emitted_chars: int = 0
    stop_reason: str | None = None
    _max_stop_len: int = field(init=False)

    def __post_init__(self) -> None:
        self._max_stop_len = max((len(s) for s in self.params.stop_strings), default=0)

    @classmethod
    def for_prompt(
        cls, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams
    ) -> "IncrementalDetokenizer":
        context = list(prompt_token_ids[-_PREFIX_WINDOW:])
        return cls(tokenizer, params, context, prefix_offset=0, read_offset=len(context))

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.params.skip_special_tokens)

    def add_tokens(self, new_token_ids: list[int]) -> bool:
        """Appends generated tokens to the text; True if a stop string ended the sequence."""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            new_text = self._decode(self.token_ids[self.prefix_offset :])
            if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
                continue  # an incomplete character: wait for the next token
            old_len = len(self.text)
            self.text += new_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            if self._max_stop_len and self._check_stop(old_len):
                return True
        return False

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
