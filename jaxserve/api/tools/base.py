"""Tool calls in model output: the parser interface, the streaming of calls as OpenAI deltas, and the
pieces every format shares.

A parser turns an output that may still be arriving into `Scan`: the text that is surely content, and
the calls found so far, each with its name once complete and the raw text of its arguments as far as
it has arrived. One scan serves both paths: `parse` reads a finished output; `ToolCallStream` scans
the growing text after every delta and sends what is new (a call's id and name once, then argument
fragments), so the fragments of a call always join to the arguments `parse` reports.
"""

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from jaxserve.api.tools.json_scan import Member, is_json, object_members, skip_whitespace


@dataclass(frozen=True)
class PartialCall:
    name: str | None  # once its string is complete
    arguments: str  # raw JSON text of the arguments so far ("" until they start)
    complete: bool  # the call's object (and so its arguments) is closed
    end: int | None = None  # index after the call in the text, once complete


@dataclass(frozen=True)
class Scan:
    content: str  # text that is content whatever comes next
    calls: list[PartialCall]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: new_call_id())


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker` (to hold back while
    streaming, so a half-arrived marker is never sent as content)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def call_in_object(text: str, start: int, name_keys: tuple[str, ...], argument_keys: tuple[str, ...]) -> PartialCall:
    """The call written as the JSON object at text[start] ('{'): its name and arguments members."""
    members, end = object_members(text, start)
    by_key: dict[str, Member] = {m.key: m for m in members}
    name = None
    name_member = next((by_key[k] for k in name_keys if k in by_key), None)
    if name_member is not None and name_member.end is not None:
        try:
            value = json.loads(text[name_member.start : name_member.end])
        except (ValueError, RecursionError):
            value = None
        name = value if isinstance(value, str) else None
    args_member = next((by_key[k] for k in argument_keys if k in by_key), None)
    arguments = "" if args_member is None else text[args_member.start : args_member.end or len(text)]
    if end is not None and args_member is None:
        arguments = "{}"  # a call without arguments
    return PartialCall(name, arguments, complete=end is not None, end=end)


def calls_in_sequence(
    text: str, start: int, separator: str, name_keys: tuple[str, ...], argument_keys: tuple[str, ...]
) -> list[PartialCall]:
    """Call objects from text[start] on, one after another with `separator` between them, as far as
    they have arrived."""
    calls: list[PartialCall] = []
    while start < len(text) and text[start] == "{":
        call = call_in_object(text, start, name_keys, argument_keys)
        calls.append(call)
        if call.end is None:
            break
        start = skip_whitespace(text, call.end)
        if start < len(text) and text[start] == separator:
            start = skip_whitespace(text, start + 1)
    return calls


class ToolParser:
    """One model family's way of writing tool calls. Subclasses implement `scan`."""

    name: ClassVar[str]
    keeps_special_tokens: ClassVar[bool] = False  # its markers are special tokens, kept in the text

    def __init__(self, functions: Sequence[dict[str, Any]] = ()) -> None:
        """`functions`: the request's tools (each a name, description and parameters' schema), which a format
        whose arguments are not JSON reads to type them (Qwen3-Coder's); the JSON formats need none."""

    def scan(self, text: str, final: bool) -> Scan:
        """What `text` holds so far; `final` when no more text will come (nothing is held back)."""
        raise NotImplementedError

    def scan_output(self, text: str, truncated: bool) -> Scan:
        """A finished output's scan; `truncated`: cut by max_tokens (a format that reads a call left open at
        the output's end as ended, Qwen3-Coder's, must not when it was cut)."""
        return self.scan(text, final=True)

    def parse(self, text: str, truncated: bool = False) -> tuple[str | None, list[ToolCall]]:
        """A finished output as (content, calls). An output whose calls do not all parse is content, unless
        it was `truncated` (cut by max_tokens) after its last complete call: then those calls are kept."""
        scan = self.scan_output(text, truncated)
        calls = [ToolCall(c.name, c.arguments, self.new_call_id()) for c in scan.calls
                 if c.complete and c.name is not None and is_json(c.arguments)]
        if truncated and calls and len(calls) == len(scan.calls) - 1 and not scan.calls[-1].complete:
            return scan.content or None, calls
        if not scan.calls or len(calls) != len(scan.calls):
            return self.unparsed(text, scan), []
        return scan.content or None, calls

    def unparsed(self, text: str, scan: Scan) -> str | None:
        """The content of an output whose calls (if any) do not all parse: the text as written."""
        return text

    @staticmethod
    def new_call_id() -> str:
        """A call's id (a format may need its own: Mistral's templates take nine alphanumerics)."""
        return new_call_id()


class TypedArgumentsParser(ToolParser):
    """A format that writes each argument as text of its own (Qwen3-Coder's, GLM-4.5's), typed by the request's schema
    for it (`type_value`). A scan reads an output that ended by itself (`closes_at_end`) as closing its open value
    and call there; one cut by max_tokens does not (its last value may be cut too). The arguments grow as a JSON
    object one argument at a time, so a stream sends each argument whole and the object's brace last."""

    def __init__(self, functions: Sequence[dict[str, Any]] = ()) -> None:
        # name -> its parameters' properties (each a JSON schema)
        self._properties: dict[str, dict[str, Any]] = {}
        for function in functions:
            parameters = function.get("parameters") or {}
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            self._properties[function.get("name", "")] = properties if isinstance(properties, dict) else {}
        # (function, argument, its text) -> its value: a stream scans its growing text after every delta, and
        # typing a large object argument again each time would grow with the square of its length
        self._typed: dict[tuple[str, str, str], Any] = {}

    @staticmethod
    def type_value(text: str, schema: dict[str, Any] | None) -> Any:
        """An argument's text as the value its schema says."""
        raise NotImplementedError

    def scan(self, text: str, final: bool) -> Scan:
        return self._scan(text, final, closes_at_end=final)

    def scan_output(self, text: str, truncated: bool) -> Scan:
        return self._scan(text, True, closes_at_end=not truncated)

    def _scan(self, text: str, final: bool, closes_at_end: bool) -> Scan:
        raise NotImplementedError

    def _value(self, function: str, key: str, text: str) -> Any:
        cached = (function, key, text)
        if cached not in self._typed:
            self._typed[cached] = self.type_value(text, self._properties.get(function, {}).get(key))
        return self._typed[cached]

    @staticmethod
    def closed_call(name: str, arguments: dict[str, Any], end: int) -> PartialCall:
        return PartialCall(name, _arguments_json(arguments), complete=True, end=end)

    @staticmethod
    def open_call(name: str, arguments: dict[str, Any]) -> PartialCall:
        """The arguments so far, without the closing brace, so later scans only append to them."""
        return PartialCall(name, _arguments_json(arguments)[:-1] if arguments else "{", complete=False)


def _arguments_json(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False)  # as vLLM writes them: text stays readable


@dataclass
class _SentCall:
    id: str
    name_sent: bool = False
    arguments_sent: int = 0  # characters of its arguments already sent


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    id: str | None = None  # with the name, in the call's first delta
    name: str | None = None
    arguments: str | None = None


class ToolCallStream:
    """Turns one choice's text deltas into content deltas and tool-call deltas."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self._parser = parser
        self._max_calls = max_calls  # parallel_tool_calls = false: only the first call
        self._text = ""
        self._content_sent = 0
        self._calls: list[_SentCall] = []

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def feed(self, text_delta: str, final: bool = False, truncated: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """(new content, new call pieces) after `text_delta`; `final` on the choice's last delta, `truncated`
        where max_tokens ended it."""
        self._text += text_delta
        scan = self._parser.scan_output(self._text, truncated) if final else self._parser.scan(self._text, False)
        content = scan.content[self._content_sent :]
        self._content_sent = max(self._content_sent, len(scan.content))
        deltas: list[ToolCallDelta] = []
        for index, call in enumerate(scan.calls[: self._max_calls]):
            if index == len(self._calls):
                if call.name is None:
                    break  # a call's name goes out first, in its first delta
                self._calls.append(_SentCall(self._parser.new_call_id()))
            sent = self._calls[index]
            first = not sent.name_sent
            fragment = call.arguments[sent.arguments_sent :]
            if first or fragment:
                deltas.append(ToolCallDelta(index, sent.id if first else None, call.name if first else None,
                                            fragment))
                sent.name_sent, sent.arguments_sent = True, len(call.arguments)
        return content, deltas
