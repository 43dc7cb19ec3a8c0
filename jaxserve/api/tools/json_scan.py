"""Reading JSON that is still arriving: where a value ends, if it has ended yet.

Tool calls stream as the model writes them, so the parsers look at text that usually stops inside a
value. These helpers never raise on an unfinished value (they return None); they do not validate
either: a finished call is checked with `json.loads` before it is reported.
"""

import json
from dataclasses import dataclass

_WHITESPACE = " \t\r\n"
_LITERAL_ENDS = ",}]; \t\r\n"


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """text[i] is '"': the index after its closing quote, or None while the string is open."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value that starts at text[i], or None while it may still grow."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return string_end(text, i)
    if text[i] in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number or literal ends at a delimiter; at the end of the text it may go on
    while j < len(text) and text[j] not in _LITERAL_ENDS:
        j += 1
    return j if j < len(text) else None


@dataclass(frozen=True)
class Member:
    key: str
    start: int  # where the value starts
    end: int | None  # after the value; None while it is arriving


def object_members(text: str, i: int) -> tuple[list[Member], int | None]:
    """text[i] is '{': its members as far as they have arrived, and the index after its '}' once it
    has one (None while open, or when what follows cannot be JSON)."""
    members: list[Member] = []
    j = skip_whitespace(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            return members, j + 1
        if text[j] == ",":
            j = skip_whitespace(text, j + 1)
            continue
        if text[j] != '"':
            return members, None
        key_end = string_end(text, j)
        if key_end is None:
            return members, None
        try:
            key = json.loads(text[j:key_end])
        except ValueError:
            return members, None
        j = skip_whitespace(text, key_end)
        if j >= len(text) or text[j] != ":":
            return members, None
        j = skip_whitespace(text, j + 1)
        if j >= len(text):
            return members, None
        end = value_end(text, j)
        members.append(Member(key, j, end))
        if end is None:
            return members, None
        j = skip_whitespace(text, end)
    return members, None


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's parser goes
        return False
    return True
