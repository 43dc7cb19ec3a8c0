"""GLM-4.5's calls (vLLM's `glm45`, and `glm47` for GLM-4.7's spelling): a block per call, its function's name,
then a key and a value element per argument, after optional content.

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

GLM-4.7 writes the same without the newlines (`<tool_call>get_weather<arg_key>city</arg_key>...`): the name ends
at the first newline, `<arg_key>` or `</tool_call>`, so one parser reads both. GLM's chat templates write a string
argument as it is and any other as JSON, so, as vLLM reads them, a value (whitespace around it taken off) stays text
where the request's schema types the argument "string", and is read as JSON (or as a Python literal) otherwise,
staying text where it does not parse or has no JSON form. A `<tool_call>` is a call once its name is followed by
`<arg_key>` or `</tool_call>` (a marker in prose is content). An output that stopped by itself inside a call ends
its open value and call there, as the Qwen3-Coder parser reads its own (vLLM's GLM parser drops such a call); one
cut by max_tokens keeps only its complete calls. The arguments grow as a JSON object one argument at a time (each
typed once its `</arg_value>` arrives), so a stream sends each argument whole and the object's brace last; a
repeated argument keeps its first value.
"""

import ast
import json
import re
from typing import Any

from jaxserve.api.tools.base import PartialCall, Scan, TypedArgumentsParser, held_back
from jaxserve.api.tools.json_scan import skip_whitespace

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"
_NAME_ENDS = ("\n", KEY_START, CALL_END)
# The most characters a call's name (and the space around it) may take: OpenAI's names are at most 64. A
# `<tool_call>` in prose is then ruled out after this many characters, not after a search of the rest of the text
# (a stream scans its text again after every delta).
MAX_NAME = 256
# A key ends at its closing tag, a value at its own; where a model leaves one out, at the next element or the
# call's end (as the Qwen3-Coder parser reads its own), never past the call
_KEY_END = re.compile("|".join(map(re.escape, (KEY_END, VALUE_START, CALL_END))))
_VALUE_END = re.compile("|".join(map(re.escape, (VALUE_END, KEY_START, CALL_END))))


def glm_value(text: str, schema: dict[str, Any] | None) -> Any:
    """An argument's text as GLM's templates wrote it: itself, exactly, where its schema's type is "string", else
    the JSON (or Python literal) it spells, whitespace around it aside, or itself where it spells none or one
    without a JSON form (NaN, a set)."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        return text
    for read in (json.loads, ast.literal_eval):
        try:
            value = read(text.strip())
            json.dumps(value, allow_nan=False)
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            continue
        return value
    return text


class Glm45ToolParser(TypedArgumentsParser):
    name = "glm45"
    type_value = staticmethod(glm_value)

    def _scan(self, text: str, final: bool, closes_at_end: bool) -> Scan:
        first, calls = None, []
        position = text.find(CALL_START)
        while position >= 0:
            call = self._call(text, position, final, closes_at_end)
            if call is None:  # a marker in prose, not a call: look past it
                position = text.find(CALL_START, position + 1)
                continue
            first = position if first is None else first
            calls.append(call)
            position = text.find(CALL_START, call.end) if call.end is not None else -1
        if first is None:
            return Scan(text[: len(text) - (0 if final else held_back(text, CALL_START))], [])
        if final and all(call.name is None for call in calls):  # markers but no call: all of it is content
            return Scan(text, [])
        return Scan(text[:first], calls)

    def _call(self, text: str, position: int, final: bool, closes_at_end: bool) -> PartialCall | None:
        """The call whose `<tool_call>` is at text[position] as far as it has arrived; None where what follows is
        not a call (a name, then `<arg_key>` or `</tool_call>`). With `closes_at_end` (the output ended by itself)
        a call or value still open ends at the output's end, as the Qwen3-Coder parser reads its own."""
        name_start = position + len(CALL_START)
        window = name_start + MAX_NAME + len(CALL_END)  # holds any marker ending a name of MAX_NAME characters
        ends = [found for marker in _NAME_ENDS if (found := text.find(marker, name_start, window)) >= 0]
        if not ends:
            return None if final or len(text) >= window else PartialCall(None, "", False)
        name_end = min(ends)
        after = skip_whitespace(text, name_end)
        rest = text[after : after + len(CALL_END)]
        if not (rest.startswith((KEY_START, CALL_END)) or (after >= len(text) and closes_at_end)):
            if final or not (KEY_START.startswith(rest) or CALL_END.startswith(rest)):
                return None  # what follows the name is neither an argument nor the call's end
            return PartialCall(None, "", False)  # the name's call is still to be confirmed
        name = text[name_start:name_end].strip()
        arguments: dict[str, Any] = {}
        position = after
        while True:
            position = skip_whitespace(text, position)
            if text.startswith(CALL_END, position):
                return self.closed_call(name, arguments, position + len(CALL_END))
            if closes_at_end and position >= len(text):
                return self.closed_call(name, arguments, position)
            if not text.startswith(KEY_START, position):
                break  # an argument or the call's end still arriving, or text that is neither
            key_end = _KEY_END.search(text, position + len(KEY_START))
            if key_end is None or key_end.group() == CALL_END:
                break  # a key still arriving, or a call's end where its value should be
            key = text[position + len(KEY_START) : key_end.start()].strip()
            value_start = skip_whitespace(text, key_end.end() if key_end.group() == KEY_END else key_end.start())
            if not text.startswith(VALUE_START, value_start):
                break
            value_end = _VALUE_END.search(text, value_start + len(VALUE_START))
            if value_end is None and not closes_at_end:
                break
            end, marker = (value_end.start(), value_end.group()) if value_end else (len(text), "")
            if key not in arguments:  # a repeated argument keeps its first value (a stream has sent it)
                arguments[key] = self._value(name, key, text[value_start + len(VALUE_START) : end])
            position = end + (len(VALUE_END) if marker == VALUE_END else 0)
        if closes_at_end:  # text that is neither an argument nor the call's end: the call ends before it
            return self.closed_call(name, arguments, position)
        return self.open_call(name, arguments)

class Glm47ToolParser(Glm45ToolParser):
    name = "glm47"  # vLLM's name for GLM-4.7's spelling, which the same parser reads

