"""OpenAI's harmony format, which GPT-OSS writes its outputs in, read as messages as far as they have arrived.

An output is a run of messages, each a header and a body:

    [<|start|>assistant][ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ json|<|constrain|>json]<|message|>BODY END

END is `<|end|>` (more messages follow), `<|call|>` (the body is a tool call's arguments, for RECIPIENT) or
`<|return|>` (the turn is over); the last two stop generation, so an output usually ends without them.
The prompt ends with `<|start|>assistant`, so the first message starts at its channel or its recipient.
The channels are `analysis` (reasoning), `commentary` (tool calls, and preambles shown to the user) and
`final` (the answer).

Both readers of harmony text use `next_message`: the reasoning split (`HarmonyStream`) and the tool-call
parser (`jaxserve.api.tools.harmony`). Text that is not a message (a model that strays from the format)
is a message of no channel.
"""

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")  # end a message, dropped with it
BREAKS = (START, CHANNEL)  # begin the next message: end a body that was never ended
_MARKERS = ENDS + BREAKS
# A whole header, from the message's start to its body's; the recipient comes before the channel or after it
# (before it with no <|start|> only at the output's start, where the prompt wrote <|start|>assistant).
_HEADER_END = r"<\|channel\|>\s*([^<\s]*)[^<]*(?:<\|constrain\|>[^<]*)?" + re.escape(MESSAGE)
_HEADER = re.compile(r"(?:<\|start\|>[^<]*)?" + _HEADER_END)
_FIRST_HEADER = re.compile(r"(?:<\|start\|>[^<]*|\s*to=[^<]*)?" + _HEADER_END)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_MAX_HEADER = 256  # characters: a longer run without <|message|> is not a header


@dataclass(frozen=True)
class Message:
    """One message of harmony text as far as it has arrived (indices into the text)."""

    start: int  # where its header starts (its text, for text outside any message)
    channel: str | None  # None for text outside any message
    recipient: str | None  # "functions.get_weather" for a call
    body_start: int
    body_end: int  # the end of its body so far: before its END, or before a marker still arriving
    end: int | None  # after its END once it has one (None while it may go on)


_LONGEST = max(map(len, _MARKERS))


def _held(text: str) -> int:
    """How many trailing characters of `text` could begin a marker, to be held back while streaming (every
    marker begins with '<')."""
    index = text.find("<", max(0, len(text) - (_LONGEST - 1)))
    while index >= 0:
        tail = text[index:]
        if any(marker.startswith(tail) for marker in _MARKERS):
            return len(text) - index
        index = text.find("<", index + 1)
    return 0


def _may_become_header(text: str, at_output_start: bool) -> bool:
    """Whether `text`, the start of a message with no <|message|> yet, may still grow into a header."""
    if len(text) >= _MAX_HEADER or any(marker in text for marker in (*ENDS, MESSAGE)):
        return False  # a header ends at its first <|message|>, before any END
    if at_output_start and (text.lstrip().startswith("to=") or "to=".startswith(text.lstrip())):
        return True
    return any(text.startswith(opener) or opener.startswith(text) for opener in BREAKS)


def _body(text: str, message_start: int, body_start: int, final: bool, resume: int) -> tuple[int, int | None]:
    """(body_end, end) of the body at text[body_start:]: it ends at an END (dropped) or where the next
    message breaks in (a break at the message's very start is not one: that text is no header). No marker
    starts before `resume`."""
    stop, end = len(text), None
    for marker in ENDS:
        index = text.find(marker, max(body_start, resume))
        if 0 <= index < stop:
            stop, end = index, index + len(marker)
    for marker in BREAKS:
        index = text.find(marker, max(body_start, message_start + 1, resume))
        if 0 <= index < stop:
            stop, end = index, index
    if end is None and not final:
        stop -= _held(text[max(body_start, len(text) - _LONGEST) :])
    return stop, end


def next_message(text: str, start: int, final: bool, resume: int = 0) -> Message | None:
    """The message at text[start:], or None where nothing can be said of it yet (no text, or a header still
    arriving). `final`: no more text will come. `resume`: no marker starts before it (a stream that has
    read up to there searches on from there)."""
    if start >= len(text):
        return None
    pattern = _FIRST_HEADER if start == 0 else _HEADER
    header = pattern.match(text, start, start + _MAX_HEADER)  # bounded: its runs of [^<] could backtrack
    if header is not None:
        recipient = _RECIPIENT.search(text, start, header.end())
        body_end, end = _body(text, start, header.end(), final, resume)
        return Message(start, header.group(1), recipient.group(1) if recipient else None, header.end(), body_end, end)
    if not final and _may_become_header(text[start : start + _MAX_HEADER], at_output_start=start == 0):
        return None
    body_end, end = _body(text, start, start, final, resume)
    return Message(start, None, None, start, body_end, end)


FUNCTIONS = "functions."


def is_call(message: Message) -> bool:
    """A call of one of the request's functions (harmony's built-in tools, `browser.*` and `python`, are not)."""
    return message.recipient is not None and message.recipient.startswith(FUNCTIONS) and \
        len(message.recipient) > len(FUNCTIONS)


class HarmonyStream:
    """Splits one output's harmony text deltas into (reasoning, content) deltas: the analysis channel is the
    reasoning; final and commentary messages' bodies are the content; a message to a recipient (a tool call)
    goes to the content whole, header and END included (an `<|end|>` where the next message broke in), for
    the tool-call parser to read."""

    def __init__(self) -> None:
        self._text = ""
        self._start = 0  # where the message being read starts
        self._routed = 0  # how far the text has been routed

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self._text += delta
        reasoning, content = [], []
        while (message := next_message(self._text, self._start, final, resume=self._routed)) is not None:
            if message.recipient is not None:
                sink, begin, stop = content, message.start, message.end or message.body_end
            else:
                sink = reasoning if message.channel == "analysis" else content
                begin, stop = message.body_start, message.body_end
            sink.append(self._text[max(begin, self._routed) : stop])
            self._routed = max(self._routed, stop)
            if message.end is None:
                break
            if message.recipient is not None and message.end == message.body_end:  # ended by the next message
                content.append(ENDS[0])
            self._start = self._routed = message.end
        return "".join(reasoning), "".join(content)
