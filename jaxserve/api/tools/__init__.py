"""Tool calling: parsers for the formats models write calls in (`--tool-call-parser`), and the tool
choices the grammar enforces. A new format is one small module with a `ToolParser` subclass, listed here."""

from jaxserve.api.tools.base import ToolCall, ToolCallDelta, ToolCallStream, ToolParser
from jaxserve.api.tools.hermes import HermesToolParser
from jaxserve.api.tools.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser)
}

__all__ = ["TOOL_PARSERS", "ToolCall", "ToolCallDelta", "ToolCallStream", "ToolParser"]
