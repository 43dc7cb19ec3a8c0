"""Qwen3-Coder's calls (vLLM's `qwen3_coder`): XML blocks with one element per argument, after optional content.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

An argument's text is typed by the request's schema for it, as vLLM types it: integers and numbers parsed
(an integral number as an integer), a boolean true only for "true", objects and arrays read as JSON (or as
a Python literal), "null" as null, a nullable type as its other type; what does not parse, an argument the
schema does not name, and a value with no JSON form (NaN, a set) stay strings. One newline after the
opening tag and one before the closing tag are the format's, not the value's. A call whose `<tool_call>`
is missing is still read from its `<function=`; a `<tool_call>` in prose that no function follows is
content. An output that stopped by itself before its closing tags ends its open argument and call there,
as vLLM reads it; one cut by max_tokens keeps only its complete calls. The arguments grow as a JSON object
one argument at a time (each typed once its closing tag arrives), so a stream sends each argument whole
and the object's brace last; a repeated argument keeps its first value (vLLM's the last; a stream has sent
the first).
"""

import ast
import json
import re
from typing import Any

from jaxserve.api.tools.base import PartialCall, Scan, TypedArgumentsParser, held_back
from jaxserve.api.tools.json_scan import skip_whitespace

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"
# An argument's value ends at its closing tag, or (as vLLM reads a model that leaves it out) where the next
# argument or the function's end begins
_VALUE_END = re.compile("|".join(map(re.escape, (PARAMETER_END, PARAMETER_START, FUNCTION_END, CALL_END))))
_INTEGER_TYPES = ("int", "integer", "uint", "long", "short", "unsigned")
_NUMBER_TYPES = ("number", "float", "double", "num")
_BOOLEAN_TYPES = ("boolean", "bool", "binary")
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


def typed_value(text: str, schema: dict[str, Any] | None) -> Any:
    """An argument's text as the value its schema's type names (vLLM's rules); the text itself where it does
    not parse as that type, where there is no schema, or where the value has no JSON form (NaN, a set)."""
    value = _typed(text, schema)
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return text
    return value


def _typed(text: str, schema: dict[str, Any] | None) -> Any:
    if text.lower() == "null":
        return None
    kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
    if isinstance(kind, list):  # a nullable type, ["integer", "null"]: the type it is when not null
        kind = next((k for k in kind if k != "null"), "string")
    kind = kind.strip().lower() if isinstance(kind, str) else "string"
    if kind in _STRING_TYPES:
        return text
    try:
        if kind.startswith(_INTEGER_TYPES):
            return int(text)
        if kind.startswith(_NUMBER_TYPES):
            number = float(text)
            return int(number) if number.is_integer() else number  # vLLM's: 2.0 is 2
    except (ValueError, OverflowError):
        return text
    if kind in _BOOLEAN_TYPES:
        return text.lower() == "true"  # vLLM's: anything else is false
    try:  # object, array and anything else
        return json.loads(text)
    except (ValueError, RecursionError):
        pass
    try:
        return ast.literal_eval(text)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return text


def _value_text(raw: str) -> str:
    """The format's newline after the opening tag and before the closing tag taken off."""
    raw = raw.removeprefix("\n")
    return raw.removesuffix("\n")


class _CallStarts:
    """Where the next call begins at or after a position: its `<tool_call>`, or its `<function=` without one. Each
    marker's next occurrence is kept until a search passes it, so a scan over many markers of one kind (prose full
    of `<tool_call>` tags) does not search the rest of the text for the other at each of them."""

    def __init__(self, text: str) -> None:
        self._text = text
        self._next = {CALL_START: -2, FUNCTION_START: -2}  # -2: not searched yet; -1: none after the last search

    def after(self, start: int) -> int | None:
        for marker, found in self._next.items():
            if found != -1 and found < start:
                self._next[marker] = self._text.find(marker, start)
        found = [i for i in self._next.values() if i >= 0]
        return min(found) if found else None


class Qwen3CoderToolParser(TypedArgumentsParser):
    name = "qwen3_coder"
    type_value = staticmethod(typed_value)

    def _scan(self, text: str, final: bool, closes_at_end: bool) -> Scan:
        first, calls = None, []
        starts = _CallStarts(text)
        position = starts.after(0)
        while position is not None:
            call = self._call(text, position, closes_at_end)
            if call is None:  # a marker in prose, not a call: look past it
                position = starts.after(position + 1)
                continue
            first = position if first is None else first
            calls.append(call)
            position = starts.after(call.end) if call.end is not None else None
        if first is None:
            hold = 0 if final else max(held_back(text, CALL_START), held_back(text, FUNCTION_START))
            return Scan(text[: len(text) - hold], [])
        if final:  # a marker at the end with no name after it begins nothing (a stream has sent the calls before it)
            while calls and calls[-1].name is None:
                calls.pop()
            if not calls:  # markers but no call: all of it is content
                return Scan(text, [])
        return Scan(text[:first], calls)

    def _call(self, text: str, position: int, final: bool) -> PartialCall | None:
        """The call at text[position] (an optional `<tool_call>`, then its function) as far as it has arrived;
        None where what follows `<tool_call>` is not a function. With `final` (the output ended by itself) a
        function or argument still open ends at the output's end, as vLLM reads an output that stopped short
        of its closing tags."""
        if text.startswith(CALL_START, position):
            position = skip_whitespace(text, position + len(CALL_START))
            if not text.startswith(FUNCTION_START, position):
                rest = text[position:]  # at an output's end, a bare <tool_call> begins nothing
                return PartialCall(None, "", False) if FUNCTION_START.startswith(rest) and not (final and not rest) \
                    else None
        name_end = text.find(">", position)
        if name_end < 0:
            return PartialCall(None, "", False)
        name = text[position + len(FUNCTION_START) : name_end].strip()
        arguments: dict[str, Any] = {}
        position = name_end + 1
        while True:
            position = skip_whitespace(text, position)
            if text.startswith(FUNCTION_END, position) or text.startswith(CALL_END, position) or (
                    final and position >= len(text)):
                end = position + len(FUNCTION_END) if text.startswith(FUNCTION_END, position) else position
                after = skip_whitespace(text, end)
                end = after + len(CALL_END) if text.startswith(CALL_END, after) else end
                return self.closed_call(name, arguments, end)
            if not text.startswith(PARAMETER_START, position):
                break  # the function's end or an argument still arriving, or text that is neither
            key_end = text.find(">", position)
            if key_end < 0:
                break
            key = text[position + len(PARAMETER_START) : key_end].strip()
            value_start = key_end + 1
            found = _VALUE_END.search(text, value_start)  # one pass: a stream scans again after every delta
            if found is None and not final:
                break
            value_end, marker = (found.start(), found.group()) if found else (len(text), "")
            if key not in arguments:  # a repeated argument keeps its first value (a stream has sent it)
                arguments[key] = self._value(name, key, _value_text(text[value_start:value_end]))
            position = value_end + (len(PARAMETER_END) if marker == PARAMETER_END else 0)
        if final:  # text that is neither an argument nor the function's end: the call ends before it
            return self.closed_call(name, arguments, position)
        return self.open_call(name, arguments)

