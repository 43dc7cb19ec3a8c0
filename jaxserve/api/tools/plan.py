"""What a chat request's `tools` and `tool_choice` mean for generation: the grammar that enforces a
`required` or named choice, and the parser that reads calls back out of the text."""

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxserve.api.tools.base import ToolParser
from jaxserve.api.tools.forced import NamedCallParser, RequiredCallsParser, named_structure, required_structure
from jaxserve.sampling_params import InvalidParam, StructuredOutputsParams


@dataclass(frozen=True)
class ToolPlan:
    make_parser: Callable[[], ToolParser]
    structure: StructuredOutputsParams | None  # None for "auto": the model writes as it likes
    max_calls: int | None  # 1 when parallel_tool_calls is false
    keeps_special_tokens: bool = False  # the parser reads markers that are special tokens (Mistral's)

    @property
    def forced(self) -> bool:
        return self.structure is not None


def plan_tools(
    functions: list[dict[str, Any]],  # each tool's "function": name, description, parameters
    tool_choice: str | dict[str, Any] | None,  # "none" | "auto" | "required" | {"function": {"name": ...}}
    parallel_tool_calls: bool,
    parser: type[ToolParser] | None,  # the server's --tool-call-parser with --enable-auto-tool-choice
) -> ToolPlan | None:
    """None when no call can come back (no tools, or tool_choice "none"). InvalidParam for a choice the
    request or the server cannot honour, with OpenAI's default: "auto" when tools are given."""
    if tool_choice is not None and not functions:
        raise InvalidParam("tool_choice needs tools", "tool_choice")
    if not functions or tool_choice == "none":
        return None
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise InvalidParam("tool function names must be unique", "tools")
    max_calls = None if parallel_tool_calls else 1
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        function = next((f for f in functions if f["name"] == name), None)
        if function is None:
            raise InvalidParam(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return ToolPlan(lambda: NamedCallParser(name), named_structure(function), 1)
    if tool_choice == "required":
        return ToolPlan(RequiredCallsParser, required_structure(functions, parallel_tool_calls), max_calls)
    if parser is None:
        raise InvalidParam('"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
                           "--tool-call-parser", "tool_choice")
    return ToolPlan(functools.partial(parser, functions), None, max_calls, parser.keeps_special_tokens)
