"""The API key guards the route the router serves, whatever the path or --root-path says (pure ASGI: a
Starlette app with the key middleware, no engine)."""

import asyncio

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from jaxserve.api.middleware import APIKeyMiddleware


async def _served(request) -> PlainTextResponse:
    return PlainTextResponse("served")


APP = Starlette(routes=[Route(path, _served, methods=["POST"]) for path in ("/v1/completions", "/tokenize")]
                + [Route("/health", _served, methods=["POST"])],
                middleware=[Middleware(APIKeyMiddleware, api_key="k")])


def _status(path: str, root_path: str = "", key: str | None = None) -> int:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.1"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": root_path, "headers": headers, "client": ("1.2.3.4", 1), "server": ("x", 80)}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(APP(scope, receive, send))
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


@pytest.mark.parametrize(("path", "root_path"), [
    ("/v1/completions", ""), ("/llm/v1/completions", "/llm"), ("/v1/completions", "/llm"),
    # a --root-path that is a prefix of a guarded path but not at a segment's end: the router still serves
    # the route (Starlette strips a root path only at a "/"), so the key must still be asked for
    ("/v1/completions", "/v"), ("/v1/completions", "/v1/comp"), ("/tokenize", "/tok"),
])
def test_a_guarded_route_is_served_only_with_the_key(path, root_path):
    assert _status(path, root_path) == 401
    assert _status(path, root_path, key="k") == 200


def test_open_routes_and_unknown_spellings():
    assert _status("/health") == 200, "health stays open"
    for path in ("//v1/completions", "/V1/completions", "/health/../v1/completions"):
        assert _status(path) == 404, path

