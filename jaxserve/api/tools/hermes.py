"""Hermes-style calls (Qwen2.5, Hermes 2/3 and others): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call, after optional content."""

from jaxserve.api.tools.base import PartialCall, Scan, ToolParser, call_in_object, held_back
from jaxserve.api.tools.json_scan import skip_whitespace

START = "<tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(START)
        if first < 0:
            return Scan(text if final else text[: len(text) - held_back(text, START)], [])
        calls: list[PartialCall] = []
        position = first
        while position >= 0:
            start = skip_whitespace(text, position + len(START))
            if start >= len(text) or text[start] != "{":
                break
            call = call_in_object(text, start, ("name",), ("arguments", "parameters"))
            calls.append(call)
            if call.end is None:
                break
            position = text.find(START, call.end)
        return Scan(text[:first], calls)
