"""Errors in OpenAI's envelope, and request-body parsing that never turns bad input into a 500."""

import json
from http import HTTPStatus
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from jaxserve.api.protocol import ErrorInfo, ErrorResponse

Model = TypeVar("Model", bound=BaseModel)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_union_member_tag(part: str | int) -> bool:
    """pydantic names the union member in an error's location ("prompt.list[int].0"); fields don't look
    like that (they are lower-case identifiers)."""
    return isinstance(part, str) and (not part.isidentifier() or part in _TYPE_TAGS or part[0].isupper())


class APIError(Exception):
    """Raised anywhere in a handler; the app turns it into an error response."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> ErrorResponse:
    error_type = _ERROR_TYPES.get(status, "server_error" if status >= 500 else HTTPStatus(status).phrase)
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=status))


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param).model_dump(), status_code=status)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 as soon as it grows past `limit` bytes (declared or streamed)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, model: type[Model], limit: int) -> Model:
    return validate(model, await read_json(request, limit))


async def read_json(request: Request, limit: int) -> Any:
    body = await read_body(request, limit)
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"invalid JSON in the request body: {e}") from None


def validate(model: type[Model], data: Any) -> Model:
    """The parsed request, or a 400 naming the first invalid field (never a bare 422)."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if not _is_union_member_tag(p)) or None
        raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param) from None
