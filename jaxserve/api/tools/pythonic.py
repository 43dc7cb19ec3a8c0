"""Pythonic calls (Llama 3.2 and 4, and models tuned on them): the output is a Python list of calls with
keyword arguments of literal values, `[get_weather(city="Paris", days=[1, 2]), now()]`. An output that
does not open with `[` is content. Each call is reported once its closing parenthesis arrives, with its
arguments converted to JSON (they are Python, not JSON, while they arrive)."""

import ast
import json
import re

from jaxserve.api.tools.base import PartialCall, Scan, ToolParser
from jaxserve.api.tools.json_scan import skip_whitespace

_NAME = re.compile(r"[A-Za-z_][\w.]*")
_OPENERS, _CLOSERS = "([{", ")]}"


def _call_end(text: str, i: int) -> int | None:
    """text[i] is '(': the index after its matching ')', skipping Python strings; None while open."""
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c in "'\"":
            quote = text[j : j + 3] if text[j : j + 3] in ("'''", '"""') else c
            j += len(quote)
            while j < len(text) and not text.startswith(quote, j):
                j += 2 if text[j] == "\\" else 1
            if j >= len(text):
                return None
            j += len(quote)
            continue
        if c in _OPENERS:
            depth += 1
        elif c in _CLOSERS:
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def _arguments(source: str) -> str | None:
    """A call's keyword arguments as a JSON object text, or None if they are not literals."""
    try:
        call = ast.parse(source, mode="eval").body
        if not isinstance(call, ast.Call) or call.args:
            return None
        values = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg is not None}
        if len(values) != len(call.keywords):
            return None
        return json.dumps(values)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def scan(self, text: str, final: bool) -> Scan:
        start = skip_whitespace(text, 0)
        if start >= len(text):
            return Scan(text if final else "", [])
        if text[start] != "[":
            return Scan(text, [])
        calls: list[PartialCall] = []
        i = skip_whitespace(text, start + 1)
        while i < len(text):
            name = _NAME.match(text, i)
            if name is None or name.end() >= len(text):
                if name is None and text[i] != "]":
                    return Scan(text, []) if not calls else Scan("", [*calls, PartialCall(None, "", False)])
                break
            if text[name.end()] != "(":
                return Scan(text, []) if not calls else Scan("", [*calls, PartialCall(None, "", False)])
            end = _call_end(text, name.end())
            if end is None:
                calls.append(PartialCall(name.group(), "", complete=False))
                break
            arguments = _arguments(text[i:end])
            calls.append(PartialCall(name.group(), arguments or "", complete=arguments is not None, end=end))
            if arguments is None:
                break
            i = skip_whitespace(text, end)
            if i < len(text) and text[i] == ",":
                i = skip_whitespace(text, i + 1)
        if final and not calls:
            return Scan(text, [])
        return Scan("", calls)
