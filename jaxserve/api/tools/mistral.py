"""Mistral's calls after `[TOOL_CALLS]`, in either of its formats: a JSON array of
`{"name": ..., "arguments": {...}}` (v0.3 tokenizers), or `name[ARGS]{...}` once per call (v11 and
later). Text before the first marker is content. `[TOOL_CALLS]` is a special token, so requests that
may call tools keep special tokens in their text; Mistral's templates take nine-character call ids."""

import random
import string

from jaxserve.api.tools.base import PartialCall, Scan, ToolParser, calls_in_sequence, held_back
from jaxserve.api.tools.json_scan import skip_whitespace, value_end

START = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    @staticmethod
    def new_call_id() -> str:
        return "".join(random.choices(_ID_CHARS, k=9))

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(START)
        if first < 0:
            return Scan(text if final else text[: len(text) - held_back(text, START)], [])
        start = skip_whitespace(text, first + len(START))
        if start < len(text) and text[start] == "[":
            return Scan(text[:first], calls_in_sequence(text, skip_whitespace(text, start + 1), ",", ("name",),
                                                        ("arguments", "parameters")))
        calls: list[PartialCall] = []
        position = first
        while position >= 0:
            name_start = position + len(START)
            args_at = text.find(ARGS, name_start)
            if args_at < 0:  # the name still arriving
                calls.append(PartialCall(None, "", complete=False))
                break
            arguments_start = skip_whitespace(text, args_at + len(ARGS))
            end = value_end(text, arguments_start)
            calls.append(PartialCall(text[name_start:args_at].strip() or None,
                                     text[arguments_start : end or len(text)], complete=end is not None, end=end))
            if end is None:
                break
            position = text.find(START, end)
        return Scan(text[:first], calls)
