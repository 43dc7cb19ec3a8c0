"""Pure ASGI middleware (it never buffers or wraps a streaming body): API keys, request ids, the
in-flight count, a large request's lists freed off the event loop, and the last-resort error handler. CORS
is Starlette's own."""

import asyncio
import logging
import secrets
import uuid
from collections.abc import Callable

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxserve.api.errors import ClientDisconnected, error_response
from jaxserve.collector import empty_in_pieces

# /health, /metrics and /version stay open
_GUARDED_PREFIXES = ("/v1/", "/v2/", "/tokenize", "/detokenize", "/score", "/rerank", "/classify", "/invocations",
                     "/start_profile", "/stop_profile")

logger = logging.getLogger("jaxserve.api")

# The request state's entry (`request.state.long_lists`) where `ModelServing.parse` keeps the long lists a large
# request was parsed into, for `LongListsMiddleware` to free.
LONG_LISTS = "long_lists"


def route_path(scope: Scope) -> str:
    """The path the router matches: the request's, less --root-path where it starts with it at a segment's
    end (as Starlette's router strips it); `/v` is not a prefix of `/v1/completions`."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):]
    return path


def _is_api_path(scope: Scope) -> bool:
    """An HTTP request to the API proper (what the key guards and the drain waits for)."""
    return scope["type"] == "http" and route_path(scope).startswith(_GUARDED_PREFIXES)


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if _is_api_path(scope) and scope["method"] != "OPTIONS":
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


class InFlightMiddleware:
    """Counts the API requests being answered (streams until their last byte) on `counter`, an object
    with a `num_in_flight` attribute: the figure /load reports and the shutdown drain waits on."""

    def __init__(self, app: ASGIApp, counter: object) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _is_api_path(scope):
            await self.app(scope, receive, send)
            return
        self.counter.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.counter.num_in_flight -= 1


class LongListsMiddleware:
    """Empties a large request's long lists (`LONG_LISTS` in its state) a slice at a time on a worker thread,
    once its response has been sent (a stream's last byte), refused or failed. Freed on the event loop with
    the request, one list of 200,000 chat messages held it for about 75 ms (collector.py). Its handler's
    frames may go first: what they held of the lists is only references while the state keeps them."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            long_lists = scope.get("state", {}).pop(LONG_LISTS, None)
            if long_lists:
                await asyncio.to_thread(empty_in_pieces, *long_lists)


class ErrorMiddleware:
    """The last resort for an exception no handler mapped: logged once, with its traceback, and answered
    with a 500 in OpenAI's envelope if the response has not started. (Starlette's own handler re-raises
    for the server to log again; this one is the end of the line.) A client that went away gets one
    quiet log line and no response: nobody would read it."""

    def __init__(self, app: ASGIApp, response: Callable[[], ASGIApp]) -> None:
        self.app = app
        self.response = response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking(message: Message) -> None:
            nonlocal started
            started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except ClientDisconnected:
            logger.info("%s %s: the client disconnected; its work was cancelled", scope["method"], scope["path"])
        except Exception:
            logger.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if not started:
                await self.response()(scope, receive, send)
