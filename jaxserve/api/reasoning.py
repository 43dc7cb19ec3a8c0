"""Reasoning models' `<think>...</think>` part, split from the answer (vLLM's `--reasoning-parser`).

The split is made on text, one stream at a time: `ReasoningStream.feed` takes each text delta and says
which part of it is reasoning and which is content, holding back a tail that may be the start of a
marker. The non-streamed answer is split by the same machine, so both agree on every output.

Where an output starts depends on its prompt: a prompt whose last marker is `</think>` (Qwen3's template
with enable_thinking=False) leaves the model answering; one whose last marker is `<think>` (DeepSeek-R1's
template) leaves it reasoning; with neither, DeepSeek-R1 reasons first (its `<think>` optional) and
Qwen3 reasons only if its output opens with `<think>`. Structured outputs apply once reasoning has ended
(`ReasoningMarkers.grammar_waits`: the grammar waits for the end marker's tokens).

GPT-OSS speaks OpenAI's harmony format, a run of messages whose markers are special tokens (the text then
keeps special tokens): its analysis channel is the reasoning, its final channel the answer, and a tool
call is a message of its own (`jaxserve.api.harmony` reads them). Its prompts hold earlier turns'
markers, so every output starts open; a structured output waits for the final channel's marker.
"""

import enum
from dataclasses import dataclass
from typing import Any, Protocol

from jaxserve.api.harmony import HarmonyStream


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
    answer_start: str = ""  # where the answer starts when it has its own marker (harmony's final channel)
    special_markers: bool = False  # the markers are special tokens: the output's text keeps special tokens
    phase_from_prompt: bool = True  # False: every output starts open (`ReasoningMarkers.first_phase`)
    # True: only the prompt's end says where its output starts (`ReasoningMarkers.first_phase`): GLM-4.5's
    # template closes every earlier turn's `<think></think>`, and ends with one where thinking is off
    phase_from_prompt_end: bool = False
    space_before_start: bool = False  # whitespace may come before the start marker (GLM-4.5 writes "\n<think>")
    harmony: bool = False  # the text is harmony messages (`jaxserve.api.harmony.HarmonyStream` splits it)


REASONING_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", reasons_unprompted=True),
    "qwen3": ReasoningParser("qwen3", reasons_unprompted=False),
    "glm45": ReasoningParser("glm45", reasons_unprompted=False, phase_from_prompt_end=True, space_before_start=True),
    "openai_gptoss": ReasoningParser(
        "openai_gptoss", reasons_unprompted=False, start="<|channel|>analysis<|message|>",
        end="<|end|><|start|>assistant<|channel|>final<|message|>", answer_start="<|channel|>final<|message|>",
        special_markers=True, phase_from_prompt=False, harmony=True),
}


class ReasoningSplitter(Protocol):
    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and the content in `delta` (with text held back before); `final` flushes."""
        ...


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
        parser = self._parser
        start, end = parser.start, parser.end
        reasoning = content = ""
        while text:
            if self._phase is Phase.OPENING:
                opening = text.lstrip() if parser.space_before_start else text
                if opening.startswith(start):
                    text, self._phase = opening[len(start):], Phase.REASONING
                elif not final and start.startswith(opening):
                    self._held, text = text, ""
                else:
                    self._phase = Phase.REASONING if parser.reasons_unprompted else Phase.CONTENT
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
                content += text
                text = ""
        return reasoning, content


def reasoning_stream(parser: ReasoningParser, phase: Phase) -> ReasoningSplitter:
    """The splitter of one output that starts in `phase`."""
    return HarmonyStream() if parser.harmony else ReasoningStream(parser, phase)


def split_reasoning(parser: ReasoningParser, phase: Phase, text: str) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, content), None where a part is empty."""
    reasoning, content = reasoning_stream(parser, phase).feed(text, final=True)
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
    answer_ids: tuple[int, ...]  # where the answer starts: the answer's own marker (harmony's), else the end's

    @classmethod
    def of(cls, parser: ReasoningParser, tokenizer: Any) -> "ReasoningMarkers":
        markers = (parser.start, parser.end, parser.answer_start or parser.end)
        return cls(parser, *(tuple(tokenizer.encode(marker, add_special_tokens=False)) for marker in markers))

    def first_phase(self, prompt_ids: list[int]) -> Phase:
        """Where the output of this prompt starts: after the prompt's last marker, if it has one (open for a
        parser whose prompts say nothing of it)."""
        if not self.parser.phase_from_prompt:
            return Phase.OPENING
        if self.parser.phase_from_prompt_end:
            for marker, phase in ((self.end_ids, Phase.CONTENT), (self.start_ids, Phase.REASONING)):
                if marker and tuple(prompt_ids[-len(marker):]) == marker:
                    return phase
            return Phase.OPENING
        last_start, last_end = _rfind(prompt_ids, list(self.start_ids)), _rfind(prompt_ids, list(self.end_ids))
        if last_end > last_start:
            return Phase.CONTENT
        return Phase.REASONING if last_start >= 0 else Phase.OPENING

    def grammar_waits(self, phase: Phase) -> tuple[int, ...]:
        """The tokens a structured output waits for before it applies: none once reasoning is over. Harmony's
        end marker ends with its answer's marker, so waiting for the latter covers an answer given without
        reasoning too."""
        return () if phase is Phase.CONTENT else self.answer_ids
