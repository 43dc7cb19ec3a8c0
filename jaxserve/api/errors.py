"""Errors in OpenAI's envelope, and request-body reading that never turns bad input into a 500.

A body is read within a deadline (slow or stalled uploads get a 408), capped in size (413), parsed off
the event loop when it is large, and then walked once, iteratively, so that nesting too deep for the
code after it or strings that are not valid Unicode (lone surrogates) are a 400 here, not an
exception deep inside pydantic, a tokenizer or a log line.
"""

import asyncio
import json
import typing
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from jaxserve.api.json_pieces import loads_in_pieces
from jaxserve.api.protocol import ErrorInfo, ErrorResponse

Model = TypeVar("Model", bound=BaseModel)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "service_unavailable",
}
MAX_JSON_DEPTH = 64  # tool schemas nest ~10 deep; recursion in pydantic and jinja starts near 1,000
_OFF_LOOP_BYTES = 256 * 1024  # bigger bodies are parsed, and their inputs converted, on a worker thread
_PIECEWISE_ITEMS = 1024  # a large body's list of models longer than this is validated an item at a time

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_union_member_tag(part: str | int) -> bool:
    """pydantic names the union member in an error's location ("prompt.list[int].0"); fields don't look
    like that (they are lower-case identifiers)."""
    return isinstance(part, str) and (not part.isidentifier() or part in _TYPE_TAGS or part[0].isupper())


class APIError(Exception):
    """Raised anywhere in a handler; the app turns it into an error response."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


class ClientDisconnected(Exception):
    """The client went away; its work is cancelled and nobody reads the response."""


def error_body(status: int, message: str, param: str | None = None) -> ErrorResponse:
    error_type = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=status))


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param).model_dump(), status_code=status, headers=headers)


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request body, or a 413 as soon as it grows past `limit` bytes (declared or streamed), or a
    408 if it has not fully arrived within `timeout` seconds."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"request body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g}s",
                       headers={"Connection": "close"}) from None
    except ClientDisconnect:
        raise ClientDisconnected from None
    return b"".join(chunks)


def is_large(body_bytes: int) -> bool:
    """Whether a body of this size is large enough that parsing it, or converting what it holds, is work for
    a worker thread rather than the event loop."""
    return body_bytes > _OFF_LOOP_BYTES


def parse_json(body: bytes) -> Any:
    """The parsed body, checked for depth and valid Unicode; APIError(400) otherwise. A large body is parsed
    in pieces, between which the event loop runs (its parse is on a worker thread)."""
    try:
        data = loads_in_pieces(body) if is_large(len(body)) else json.loads(body)
    except RecursionError:
        raise APIError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of more digits than Python converts
        raise APIError(400, f"invalid JSON in the request body: {e}") from None
    check_json(data)
    return data


def check_json(data: Any) -> None:
    """Rejects nesting deeper than MAX_JSON_DEPTH and strings that are not valid Unicode (a lone
    surrogate such as "\\ud800" parses, but no tokenizer or encoder accepts it). Iterative: no recursion."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            _check_unicode(value, path)
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels", path or None)
        if isinstance(value, dict):
            for key, item in value.items():
                _check_unicode(key, path)
                stack.append((item, depth + 1, f"{path}.{key}" if path else key))
        else:
            stack.extend((item, depth + 1, f"{path}.{i}" if path else str(i)) for i, item in enumerate(value))


def _check_unicode(text: str, path: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            where = f" in {path}" if path else ""
            raise APIError(400, f"invalid Unicode{where}: a lone surrogate is not a character",
                           path or None) from None


def validate(model: type[Model], data: Any, where: str = "") -> Model:
    """The parsed request, or a 400 naming the first invalid field (never a bare 422); `where`: the
    location of `data` in the body, before the fields' names."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        fields = [str(p) for p in first["loc"] if not _is_union_member_tag(p)]
        param = ".".join([where, *fields] if where else fields) or None
        raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param) from None


def validate_in_pieces(model: type[Model], data: Any) -> Model:
    """`validate` for a large body, on a worker thread: its long lists of models (a chat's messages) are
    validated an item at a time first. pydantic holds the interpreter lock through a validation call, so one
    call over 300,000 messages stopped the event loop's thread for a second; between items it runs."""
    if isinstance(data, dict):
        data = dict(data)
        for name, field in model.model_fields.items():
            key, item_model = field.alias or name, _list_item_model(field.annotation)
            items = data.get(key)
            if item_model is not None and isinstance(items, list) and len(items) > _PIECEWISE_ITEMS:
                data[key] = [validate(item_model, item, f"{key}.{i}") for i, item in enumerate(items)]
    return validate(model, data)  # the items, models already, are taken as they are


def _list_item_model(annotation: Any) -> type[BaseModel] | None:
    """M for a field of type list[M], M a model; else None."""
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item
    return None
