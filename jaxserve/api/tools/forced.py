"""Tool choices the grammar enforces (`required`, a named function): what the model must write, and
how that text reads as calls. These work with any model and need no parser.

- a named function: the output is its arguments object alone;
- `required`: a JSON array of `{"name": ..., "parameters": {...}}`, at least one (exactly one when
  parallel_tool_calls is false), each name one of the request's functions.
"""

from typing import Any

from jaxserve.api.tools.base import PartialCall, Scan, ToolCall, ToolParser, calls_in_sequence
from jaxserve.api.tools.json_scan import skip_whitespace, value_end
from jaxserve.sampling_params import StructuredOutputsParams

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or _ANY_OBJECT


def named_structure(function: dict[str, Any]) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=parameters_schema(function))


def required_structure(functions: list[dict[str, Any]], parallel: bool) -> StructuredOutputsParams:
    call = {"anyOf": [
        {"type": "object", "properties": {"name": {"const": f["name"]}, "parameters": parameters_schema(f)},
         "required": ["name", "parameters"], "additionalProperties": False}
        for f in functions
    ]}
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


class NamedCallParser(ToolParser):
    name = "named"

    def __init__(self, function_name: str) -> None:
        self._function_name = function_name

    def scan(self, text: str, final: bool) -> Scan:
        start = skip_whitespace(text, 0)
        end = value_end(text, start)
        return Scan("", [PartialCall(self._function_name, text[start:end or len(text)], complete=end is not None,
                                     end=end)])

    def parse(self, text: str, truncated: bool = False) -> tuple[str | None, list[ToolCall]]:
        """The named function's call, however the output ended (vLLM's): cut by max_tokens, its arguments as
        far as they got, as the stream sends them; never content."""
        (call,) = self.scan(text, final=True).calls
        return None, [ToolCall(call.name, call.arguments, self.new_call_id())]


class RequiredCallsParser(ToolParser):
    name = "required"

    def scan(self, text: str, final: bool) -> Scan:
        start = skip_whitespace(text, 0)
        if start >= len(text) or text[start] != "[":
            return Scan("", [])
        return Scan("", calls_in_sequence(text, skip_whitespace(text, start + 1), ",", ("name",), ("parameters",)))

    def unparsed(self, text: str, scan: Scan) -> str | None:
        """None: the grammar made the text calls, so an output cut before its first call was complete is not
        content (it was the raw JSON, where the stream had sent the call; vLLM's whole answer: no calls and no
        content). Cut later, the answer keeps its complete calls (`ToolParser.parse`)."""
        return None
