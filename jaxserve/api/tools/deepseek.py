"""DeepSeek's calls, between its special tokens (vLLM's `deepseek_v3` and `deepseek_v31` parsers):

- V3 and R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
  <｜tool▁call▁end｜>` once per call, then `<｜tool▁calls▁end｜>`;
- V3.1 and later: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` once per call, in the same
  outer pair.

Text before the first `<｜tool▁calls▁begin｜>` is content. The markers are special tokens, so requests that
may call tools keep special tokens in their text.
"""

from jaxserve.api.tools.base import PartialCall, Scan, ToolParser, held_back
from jaxserve.api.tools.json_scan import skip_whitespace, value_end

CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"
JSON_FENCE = "```json"


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    keeps_special_tokens = True

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(CALLS_BEGIN)
        if first < 0:
            return Scan(text if final else text[: len(text) - held_back(text, CALLS_BEGIN)], [])
        calls: list[PartialCall] = []
        position = text.find(CALL_BEGIN, first)
        while position >= 0:
            call = self._call(text, position + len(CALL_BEGIN))
            calls.append(call)
            if call.end is None:
                break
            position = text.find(CALL_BEGIN, call.end)
        return Scan(text[:first], calls)

    def _call(self, text: str, start: int) -> PartialCall:
        """The call whose `<｜tool▁call▁begin｜>` ends at `start`: `function<｜tool▁sep｜>NAME`, a line
        break, then its arguments in a ```json fence."""
        sep = text.find(SEP, start)
        name_end = -1 if sep < 0 else text.find("\n", sep)
        if name_end < 0:  # the name still arriving
            return PartialCall(None, "", complete=False)
        name = text[sep + len(SEP) : name_end].strip() or None
        fence = skip_whitespace(text, name_end)
        if not text.startswith(JSON_FENCE, fence):
            return PartialCall(name, "", complete=False)
        arguments_start = skip_whitespace(text, fence + len(JSON_FENCE))
        end = value_end(text, arguments_start)
        return PartialCall(name, text[arguments_start : end or len(text)], complete=end is not None, end=end)


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    name = "deepseek_v31"

    def _call(self, text: str, start: int) -> PartialCall:
        """`NAME<｜tool▁sep｜>` then the arguments' JSON."""
        sep = text.find(SEP, start)
        if sep < 0:
            return PartialCall(None, "", complete=False)
        arguments_start = skip_whitespace(text, sep + len(SEP))
        end = value_end(text, arguments_start)
        return PartialCall(text[start:sep].strip() or None, text[arguments_start : end or len(text)],
                           complete=end is not None, end=end)
