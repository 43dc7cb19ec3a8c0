"""Tool calling: parsers for the formats models write calls in (`--tool-call-parser`), and the tool
choices the grammar enforces. A new format is one small module with a `ToolParser` subclass, listed here."""

from jaxserve.api.tools.base import ToolCall, ToolCallDelta, ToolCallStream, ToolParser
from jaxserve.api.tools.deepseek import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from jaxserve.api.tools.glm45 import Glm45ToolParser, Glm47ToolParser
from jaxserve.api.tools.harmony import HarmonyToolParser
from jaxserve.api.tools.hermes import HermesToolParser
from jaxserve.api.tools.llama3_json import Llama3JsonToolParser
from jaxserve.api.tools.mistral import MistralToolParser
from jaxserve.api.tools.pythonic import PythonicToolParser
from jaxserve.api.tools.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (DeepSeekV3ToolParser, DeepSeekV31ToolParser, Glm45ToolParser, Glm47ToolParser, HarmonyToolParser,
                   HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser, Qwen3CoderToolParser)
}

__all__ = ["TOOL_PARSERS", "ToolCall", "ToolCallDelta", "ToolCallStream", "ToolParser"]
