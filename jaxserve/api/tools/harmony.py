"""GPT-OSS's calls in OpenAI's harmony format (`--tool-call-parser openai`, as vLLM names it): a message to
`functions.NAME`, usually on the commentary channel, whose body is the arguments' JSON:

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>

`<|call|>` stops generation, so a call usually ends the output. The content is what the final channel
and commentary preambles say; the analysis channel is reasoning, never content (`--reasoning-parser
openai_gptoss` returns it). The markers are special tokens, so requests that may call tools keep them.
"""

from collections.abc import Sequence
from typing import Any

from jaxserve.api.harmony import FUNCTIONS, HarmonyStream, Message, is_call, next_message
from jaxserve.api.tools.base import PartialCall, Scan, ToolParser


class HarmonyToolParser(ToolParser):
    name = "openai"
    keeps_special_tokens = True

    def unparsed(self, text: str, scan: Scan) -> str | None:
        """Never the raw text: an output without calls is its messages' content, and one whose calls do not all
        parse is that with the calls' messages whole (its analysis, the reasoning, left out)."""
        if not scan.calls:
            return scan.content or None
        return HarmonyStream().feed(text, final=True)[1] or None

    def __init__(self, functions: Sequence[dict[str, Any]] = ()) -> None:
        super().__init__(functions)
        # A stream scans its text again after every delta: what the last scan before the end read is kept, to
        # go on from where it stopped when the text has only grown (the text, the start of the message it
        # stopped in, the content and calls before that message, and how far its markers were searched).
        self._last: tuple[str, int, list[str], list[PartialCall], int] = ("", 0, [], [], 0)

    def scan(self, text: str, final: bool) -> Scan:
        return self._scan(text, final, truncated=False)

    def scan_output(self, text: str, truncated: bool) -> Scan:
        return self._scan(text, True, truncated)

    def _scan(self, text: str, final: bool, truncated: bool) -> Scan:
        last_text, start, content, calls, resume = self._last
        if not text.startswith(last_text):
            start, content, calls, resume = 0, [], [], 0
        content, calls = list(content), list(calls)
        while (message := next_message(text, start, final, resume)) is not None:
            if message.end is None:  # the message still arriving: read again next time
                if not final:
                    self._last = (text, start, content, calls, message.body_end)
                return Scan("".join(content + self._content(text, message)), calls + self._calls(
                    text, message, final and not truncated))
            content += self._content(text, message)
            calls += self._calls(text, message, True)
            start = resume = message.end
        if not final:
            self._last = (text, start, content, calls, resume)
        return Scan("".join(content), calls)

    @staticmethod
    def _content(text: str, message: Message) -> list[str]:
        return [] if is_call(message) or message.channel == "analysis" else [
            text[message.body_start : message.body_end]]

    @staticmethod
    def _calls(text: str, message: Message, ended: bool) -> list[PartialCall]:
        if not is_call(message):
            return []
        arguments = text[message.body_start : message.body_end].strip()
        return [PartialCall(message.recipient.removeprefix(FUNCTIONS), arguments, ended, message.end)]
