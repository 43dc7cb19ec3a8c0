"""Reasoning models' `<think>...</think>` part, split from the answer (vLLM's `--reasoning-parser`).

The split is made on text, one stream at a time: `ReasoningStream.feed` takes each text delta and says
which part of it is reasoning and which is content, holding back a tail that may be the start of a
marker. The non-streamed answer is split by the same machine, so both agree on every output.

Where an output starts depends on its prompt: a prompt whose last marker is `</think>` (Qwen3's template
with enable_thinking=False) leaves the model answering; one whose last marker is `<think>` (DeepSeek-R1's
template) leaves it reasoning; with neither, DeepSeek-R1 reasons first (its `<think>` optional) and
Qwen3 reasons only if its output opens with `<think>`. Structured outputs apply once reasoning has ended
(`ReasoningMarkers.grammar_waits`: the grammar waits for the end marker's tokens).
"""

import enum
from dataclasses import dataclass
from typing import Any


class Phase(enum.Enum):
    OPENING = "opening"  # nothing yet: an opening <think> may come
    REASONING = "reasoning"
    CONTENT = "content"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    reasons_unprompted: bool  # with no marker in the prompt or at the output's start, it reasons anyway
    start: str = "<think>"
    end: str = "</think>"


REASONING_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", reasons_unprompted=True),
    "qwen3": ReasoningParser("qwen3", reasons_unprompted=False),
}


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningStream:
    """Splits one output's text deltas into (reasoning, content) deltas."""

    def __init__(self, parser: ReasoningParser, phase: Phase) -> None:
        self._parser = parser
        self._phase = phase
        self._held = ""  # text that may begin a marker

    @property
    def phase(self) -> Phase:
        return self._phase

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and the content in `delta` (with text held back before); `final` flushes."""
        text, self._held = self._held + delta, ""
        start, end = self._parser.start, self._parser.end
        reasoning = content = ""
        while text:
            if self._phase is Phase.OPENING:
                if text.startswith(start):
                    text, self._phase = text[len(start):], Phase.REASONING
                elif start.startswith(text) and not final:
                    self._held, text = text, ""
                else:
                    self._phase = Phase.REASONING if self._parser.reasons_unprompted else Phase.CONTENT
            elif self._phase is Phase.REASONING:
                index = text.find(end)
                if index >= 0:
                    reasoning += text[:index]
                    text, self._phase = text[index + len(end):], Phase.CONTENT
                    continue
                keep = 0 if final else _partial_suffix(text, end)
                reasoning += text[: len(text) - keep]
                self._held, text = text[len(text) - keep:], ""
            else:
                content, text = content + text, ""
        return reasoning, content


def split_reasoning(parser: ReasoningParser, phase: Phase, text: str) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, content), None where a part is empty."""
    reasoning, content = ReasoningStream(parser, phase).feed(text, final=True)
    return reasoning or None, content or None


def _rfind(ids: list[int], marker: list[int]) -> int:
    """The last index where `marker` occurs in `ids`, or -1."""
    size = len(marker)
    for index in range(len(ids) - size, -1, -1):
        if ids[index : index + size] == marker:
            return index
    return -1


@dataclass(frozen=True)
class ReasoningMarkers:
    """A parser with its markers' token ids in the served tokenizer."""

    parser: ReasoningParser
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]

    @classmethod
    def of(cls, parser: ReasoningParser, tokenizer: Any) -> "ReasoningMarkers":
        ids = [tuple(tokenizer.encode(marker, add_special_tokens=False)) for marker in (parser.start, parser.end)]
        return cls(parser, *ids)

    def first_phase(self, prompt_ids: list[int]) -> Phase:
        """Where the output of this prompt starts: after the prompt's last marker, if it has one."""
        last_start, last_end = _rfind(prompt_ids, list(self.start_ids)), _rfind(prompt_ids, list(self.end_ids))
        if last_end > last_start:
            return Phase.CONTENT
        return Phase.REASONING if last_start >= 0 else Phase.OPENING

    def grammar_waits(self, phase: Phase) -> tuple[int, ...]:
        """The tokens a structured output waits for before it applies: none once reasoning is over."""
        return () if phase is Phase.CONTENT else self.end_ids
