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

An argument's text is typed by the request's schema for it, as vLLM types it: integers, numbers and
booleans parsed, objects and arrays read as JSON (or as a Python literal), "null" as null, anything else
and any argument the schema does not name a string; one newline after the opening tag and one before the
closing tag are the format's, not the value's. A call whose `<tool_call>` is missing is still read from
its `<function=`. The arguments grow as a JSON object one argument at a time (each is typed once its
closing tag arrives), so a stream sends each argument whole and the object's brace last.
"""

import ast
import json
from collections.abc import Sequence
from typing import Any

from jaxserve.api.tools.base import PartialCall, Scan, ToolParser, held_back
from jaxserve.api.tools.json_scan import skip_whitespace

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"
# An argument's value ends at its closing tag, or (as vLLM reads a model that leaves it out) where the next
# argument or the function's end begins
_VALUE_ENDS = (PARAMETER_END, PARAMETER_START, FUNCTION_END)
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
    kind = kind.strip().lower() if isinstance(kind, str) else "string"  # a list of types: left as text
    if kind in _STRING_TYPES:
        return text
    try:
        if kind.startswith(_INTEGER_TYPES):
            return int(text)
        if kind.startswith(_NUMBER_TYPES):
            number = float(text)
            return int(number) if number.is_integer() and text.strip().lstrip("+-").isdigit() else number
    except ValueError:
        return text
    if kind in _BOOLEAN_TYPES:
        return text.lower() == "true" if text.lower() in ("true", "false") else text
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


def _next_call(text: str, start: int) -> int | None:
    """Where the next call begins at or after `start`: its `<tool_call>`, or its `<function=` without one."""
    found = [i for i in (text.find(CALL_START, start), text.find(FUNCTION_START, start)) if i >= 0]
    return min(found) if found else None


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def __init__(self, functions: Sequence[dict[str, Any]] = ()) -> None:
        # name -> its parameters' properties (each a JSON schema)
        self._properties: dict[str, dict[str, Any]] = {}
        for function in functions:
            parameters = function.get("parameters") or {}
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            self._properties[function.get("name", "")] = properties if isinstance(properties, dict) else {}

    def scan(self, text: str, final: bool) -> Scan:
        first = _next_call(text, 0)
        if first is None:
            hold = 0 if final else max(held_back(text, CALL_START), held_back(text, FUNCTION_START))
            return Scan(text[: len(text) - hold], [])
        calls: list[PartialCall] = []
        position: int | None = first
        while position is not None:
            call = self._call(text, position)
            if call is None:
                break
            calls.append(call)
            position = _next_call(text, call.end) if call.end is not None else None
        if final and all(call.name is None for call in calls):  # markers but no call: all of it is content
            return Scan(text, [])
        return Scan(text[:first], calls)

    def _call(self, text: str, position: int) -> PartialCall | None:
        """The call at text[position] (an optional `<tool_call>`, then its function) as far as it has arrived;
        None where what follows `<tool_call>` is not a function."""
        if text.startswith(CALL_START, position):
            position = skip_whitespace(text, position + len(CALL_START))
            if not text.startswith(FUNCTION_START, position):
                return PartialCall(None, "", False) if FUNCTION_START.startswith(text[position:]) else None
        name_end = text.find(">", position)
        if name_end < 0:
            return PartialCall(None, "", False)
        name = text[position + len(FUNCTION_START) : name_end].strip()
        properties = self._properties.get(name, {})
        arguments: dict[str, Any] = {}
        position = name_end + 1
        while True:
            position = skip_whitespace(text, position)
            if text.startswith(FUNCTION_END, position):
                end = skip_whitespace(text, position + len(FUNCTION_END))
                end = end + len(CALL_END) if text.startswith(CALL_END, end) else position + len(FUNCTION_END)
                return PartialCall(name, json.dumps(arguments), complete=True, end=end)
            if not text.startswith(PARAMETER_START, position):
                break  # the function's end or an argument still arriving, or text that is neither
            key_end = text.find(">", position)
            if key_end < 0:
                break
            key = text[position + len(PARAMETER_START) : key_end].strip()
            value_start = key_end + 1
            ends = [(i, marker) for marker in _VALUE_ENDS if (i := text.find(marker, value_start)) >= 0]
            if not ends:
                break
            value_end, marker = min(ends)
            arguments.setdefault(key, typed_value(_value_text(text[value_start:value_end]), properties.get(key)))
            position = value_end + (len(PARAMETER_END) if marker == PARAMETER_END else 0)
        # Open: the arguments so far, without the closing brace, so later scans only append to them
        return PartialCall(name, json.dumps(arguments)[:-1] if arguments else "{", complete=False)
