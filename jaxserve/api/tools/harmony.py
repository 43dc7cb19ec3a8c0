"""GPT-OSS's calls in OpenAI's harmony format (`--tool-call-parser openai`, as vLLM names it): a message to
`functions.NAME`, usually on the commentary channel, whose body is the arguments' JSON:

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>

`<|call|>` stops generation, so a call usually ends the output. The content is what the final channel
and commentary preambles say; the analysis channel is reasoning, never content (`--reasoning-parser
openai_gptoss` returns it). The markers are special tokens, so requests that may call tools keep them.
"""

from jaxserve.api.harmony import is_call, next_message
from jaxserve.api.tools.base import PartialCall, Scan, ToolCall, ToolParser

_FUNCTIONS = "functions."


class HarmonyToolParser(ToolParser):
    name = "openai"
    keeps_special_tokens = True

    def parse(self, text: str, truncated: bool = False) -> tuple[str | None, list[ToolCall]]:
        """As any parser's, but an output without calls is the content of its messages, not its raw text."""
        scan = self.scan_output(text, truncated)
        return (scan.content or None, []) if not scan.calls else super().parse(text, truncated)

    def scan(self, text: str, final: bool) -> Scan:
        return self._scan(text, final, truncated=False)

    def scan_output(self, text: str, truncated: bool) -> Scan:
        return self._scan(text, True, truncated)

    @staticmethod
    def _scan(text: str, final: bool, truncated: bool) -> Scan:
        content: list[str] = []
        calls: list[PartialCall] = []
        start = 0
        while (message := next_message(text, start, final)) is not None:
            if is_call(message):
                ended = message.end is not None or (final and not truncated)
                arguments = text[message.body_start : message.body_end].strip()
                calls.append(PartialCall(message.recipient.removeprefix(_FUNCTIONS), arguments, ended, message.end))
            elif message.channel != "analysis":
                content.append(text[message.body_start : message.body_end])
            if message.end is None:
                break
            start = message.end
        return Scan("".join(content), calls)
