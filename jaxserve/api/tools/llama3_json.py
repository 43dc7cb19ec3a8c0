"""Llama 3.1 / 3.2 JSON calls: the whole output is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several separated by `;`. An output that starts otherwise is content."""

from jaxserve.api.tools.base import Scan, ToolParser, calls_in_sequence
from jaxserve.api.tools.json_scan import skip_whitespace

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def scan(self, text: str, final: bool) -> Scan:
        start = skip_whitespace(text, 0)
        if text.startswith(PYTHON_TAG, start):
            start = skip_whitespace(text, start + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[start:]):
            return Scan("", [])  # nothing yet, or the tag arriving
        if start >= len(text):
            return Scan(text if final else "", [])
        if text[start] != "{":
            return Scan(text, [])
        return Scan("", calls_in_sequence(text, start, ";", ("name",), ("parameters", "arguments")))
