"""JSON of large bodies in pieces that let the event loop run between them: `json.loads` of a request's,
and a large answer's model dumped and encoded (`dumps_in_pieces`).

`json.loads` is one C call, and it holds the interpreter lock for all of it: on a worker thread, a 16 MiB
body still stops the event loop for the whole parse. Here the body's object and the containers in its
fields are walked by a Python loop, and each piece inside them (a message, a string, a list of token ids)
is one call of the standard library's own scanner, so the lock passes to the event loop between pieces
(every `sys.getswitchinterval()`). The result, and what is an error, are `json.loads`'s.

An array of numbers (a prompt's token ids) is one scanner call whole: walked, its items cost several times
their parse, and none of them is long.

The same holds the other way: pydantic's `model_dump` and `json.dumps` are one call each over a whole
answer (128 choices of 40 tokens with 20 alternatives each: 0.4 s and 0.2 s). `dumps_in_pieces` walks the
answer's models and lists near the top in Python and dumps and encodes each piece under them (a token's
logprobs, a choice's text) in one call: the same bytes as Starlette's `JSONResponse` of `model_dump()`.
"""

import json
import json.decoder
import re
from typing import Any

from pydantic import BaseModel

_WALKED_DEPTH = 2  # the body's object and its fields' containers are walked; deeper values are one call each
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_AFTER_ITEM = re.compile(r"[ \t\n\r]*([,\]])[ \t\n\r]*")  # an array's delimiter or its end, and the space after
_SCAN = json.JSONDecoder().scan_once  # (value, index after it) of the value at an index, as json.loads reads it


def loads_in_pieces(body: bytes) -> Any:
    """The same value as `json.loads(body)`, or the same kind of error (a `ValueError`)."""
    text = body.decode(json.detect_encoding(body), "surrogatepass")  # as json.loads decodes bytes
    value, end = _value(text, _skip(text, 0), 1)
    end = _skip(text, end)
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


_WALKED_DUMP_DEPTH = 5  # the answer (0), its choices, a choice, its logprobs, their list, each token's (5)
_SCALARS = (str, int, float, bool, type(None))


def _model_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, BaseModel):
        return value.model_dump()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# JSONResponse's encoding (of `model_dump()`: a model met inside a piece is dumped as its parent's dump would)
_ENCODE = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=_model_dict).encode


def dumps_in_pieces(value: Any) -> bytes:
    """`JSONResponse(value.model_dump()).body` for a response model of plain fields (no aliases or
    serializers), its parts near the top walked in Python and each piece below them one call."""
    return "".join(_dump_pieces(value, 0)).encode()


def _dump_pieces(value: Any, depth: int) -> list[str]:
    if depth >= _WALKED_DUMP_DEPTH:
        return [_ENCODE(value)]
    if isinstance(value, BaseModel):
        value = {name: getattr(value, name) for name in type(value).model_fields}
    if isinstance(value, dict):
        pieces = ["{"]
        for index, (key, item) in enumerate(value.items()):
            pieces += [("," if index else "") + _ENCODE(_key_text(key)) + ":", *_dump_pieces(item, depth + 1)]
        return [*pieces, "}"]
    if isinstance(value, list) and not all(isinstance(item, _SCALARS) for item in value):
        pieces = ["["]
        for index, item in enumerate(value):
            pieces += [","] if index else []
            pieces += _dump_pieces(item, depth + 1)
        return [*pieces, "]"]
    return [_ENCODE(value)]


def _key_text(key: Any) -> str:
    """A dict key as `json.dumps` writes it: text as it is, else true, false, null or the number's JSON."""
    if isinstance(key, str):
        return key
    if isinstance(key, bool) or key is None:
        return {True: "true", False: "false", None: "null"}[key]
    return _ENCODE(key)  # an int or a float


def _skip(text: str, index: int) -> int:
    return _WHITESPACE.match(text, index).end()


def _value(text: str, index: int, depth: int) -> tuple[Any, int]:
    """The value starting at `index` (no whitespace before it) and the index after it."""
    if depth <= _WALKED_DEPTH:
        if text.startswith("{", index):
            return _object(text, index + 1, depth)
        if text.startswith("[", index):
            first = _skip(text, index + 1)
            if text[first:first + 1] in ("{", "[", '"'):
                return _array(text, first, depth)
    return _scan(text, index)


def _scan(text: str, index: int) -> tuple[Any, int]:
    try:
        return _SCAN(text, index)
    except StopIteration as e:
        raise json.JSONDecodeError("Expecting value", text, e.value) from None


def _object(text: str, index: int, depth: int) -> tuple[dict[str, Any], int]:
    """The object whose "{" ends just before `index`."""
    result: dict[str, Any] = {}
    index = _skip(text, index)
    if text.startswith("}", index):
        return result, index + 1
    while True:
        if not text.startswith('"', index):
            raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, index)
        key, index = json.decoder.scanstring(text, index + 1, True)
        index = _skip(text, index)
        if not text.startswith(":", index):
            raise json.JSONDecodeError("Expecting ':' delimiter", text, index)
        result[key], index = _value(text, _skip(text, index + 1), depth + 1)
        index = _skip(text, index)
        if text.startswith("}", index):
            return result, index + 1
        if not text.startswith(",", index):
            raise json.JSONDecodeError("Expecting ',' delimiter", text, index)
        index = _skip(text, index + 1)


def _array(text: str, index: int, depth: int) -> tuple[list[Any], int]:
    """The array whose first item (an object, array or string) starts at `index`."""
    result: list[Any] = []
    append, after_item = result.append, _AFTER_ITEM.match
    while True:  # (a large body's longest loop: one scanner call and one match an item)
        item, index = _value(text, index, depth + 1)
        append(item)
        delimiter = after_item(text, index)
        if delimiter is None:
            raise json.JSONDecodeError("Expecting ',' delimiter", text, _skip(text, index))
        index = delimiter.end()
        if delimiter.group(1) == "]":
            return result, index
