"""Pure ASGI middleware (it never buffers or wraps a streaming body): API keys and request ids.
CORS is Starlette's own."""

import secrets
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxserve.api.errors import error_response

_GUARDED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")  # /health, /metrics and /version stay open


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if path.startswith(_GUARDED_PREFIXES):
                given = Headers(scope=scope).get("authorization", "").encode()
                if not secrets.compare_digest(given, self._expected):
                    response = error_response(401, "Incorrect API key provided.")
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """Echoes the client's X-Request-Id; with `generate`, makes one up when the client sent none."""

    def __init__(self, app: ASGIApp, generate: bool) -> None:
        self.app = app
        self.generate = generate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("x-request-id") or (uuid.uuid4().hex if self.generate else None)
        if request_id is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)
