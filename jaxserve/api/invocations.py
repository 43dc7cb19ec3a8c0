"""POST /invocations: SageMaker's one inference route (its health route is /ping, in misc.py), as vLLM serves
it: the body's fields pick the endpoint that answers it, which then reads the same body and answers as it
does at its own path (streaming included).

A generating server answers a body with `messages` as /v1/chat/completions and one with `prompt` as
/v1/completions; a `--runner pooling` server answers `query` with `documents` as /v1/rerank, `text_1` or
`text_2` as /v1/score, and `input` or `messages` as /v1/embeddings (as /classify where the model is a
classifier). Anything else is a 400 that lists what this server takes.
"""

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from jaxserve.api import chat, classify, completions, embeddings, scores
from jaxserve.api.errors import APIError
from jaxserve.api.serving import get_serving

Handler = Callable[[Request], Awaitable[Response]]

# (the fields that pick it, all of which the body must hold; the handler; the path it stands for), in order
_GENERATE: tuple[tuple[tuple[str, ...], Handler, str], ...] = (
    (("messages",), chat.create_chat_completion, "/v1/chat/completions"),
    (("prompt",), completions.create_completion, "/v1/completions"),
)
_POOLING: tuple[tuple[tuple[str, ...], Handler, str], ...] = (
    (("query", "documents"), scores.create_rerank, "/v1/rerank"),
    (("text_1",), scores.create_score, "/v1/score"),
    (("text_2",), scores.create_score, "/v1/score"),
    (("input",), embeddings.create_embedding, "/v1/embeddings"),
    (("messages",), embeddings.create_embedding, "/v1/embeddings"),
)
_CLASSIFIER: tuple[tuple[tuple[str, ...], Handler, str], ...] = (
    *_POOLING[:3], (("input",), classify.create_classification, "/classify"),
    (("messages",), classify.create_classification, "/classify"),
)


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def handler_for(body: object, runner: str, classifier: bool = False) -> Handler:
    """The handler that answers `body` on a server whose engine runs `runner` ("generate" or "pooling"), of a
    `classifier` or not: the first whose fields the body holds, not null."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, not {_JSON_TYPES.get(type(body), 'that')}")
    routes = _GENERATE if runner != "pooling" else _CLASSIFIER if classifier else _POOLING
    for fields, handler, _ in routes:
        if all(body.get(field) is not None for field in fields):
            return handler
    takes = "; ".join(f"{' and '.join(fields)} ({path})" for fields, _, path in routes)
    raise APIError(400, f"no endpoint of this server takes this body: /invocations takes a body with {takes}")


async def invoke(request: Request) -> Response:
    serving = get_serving(request)
    body = await serving.read_json(request)
    return await handler_for(body, serving.info.runner, bool(serving.info.class_labels))(request)
