"""GET /openapi.json and /docs: an OpenAPI 3.1 description of every route the app serves.

Every schema comes from the pydantic models in `protocol.py` that the handlers validate with and answer
with, so the document cannot drift from what the server accepts; this module only says which route reads
and writes which model (the `OPERATIONS` table). `tests/api/test_openapi.py` checks that the table and the
app's routes agree both ways, and `tests/api/test_fuzz.py` fuzzes a real server from this document.

/docs is Swagger UI as FastAPI serves it: a small HTML page whose scripts the *browser* loads from a CDN;
the server itself never makes a network call. Neither route is in the document (FastAPI's convention),
and neither is behind `--api-key`, so a client can discover the API before it has a key.
"""

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from jaxserve import __version__
from jaxserve.api.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ClassificationChatRequest,
    ClassificationRequest,
    ClassificationResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingChatRequest,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    InputItemsQuery,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    RerankRequest,
    RerankResponse,
    ResponseDeleted,
    ResponseEvent,
    ResponseItemList,
    ResponseObject,
    ResponseQuery,
    ResponsesRequest,
    ScoreRequest,
    ScoreResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    UnloadLoraAdapterRequest,
)
from jaxserve.api.scores import RERANK_PATHS, SCORE_PATHS
from jaxserve.config import ServerConfig

OPENAPI_VERSION = "3.1.0"
REF_TEMPLATE = "#/components/schemas/{model}"
SWAGGER_UI_CDN = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5"

_ERROR_MEANINGS = {
    400: "Invalid JSON, an invalid field, or a prompt longer than the context.",
    401: "Missing or wrong API key.",
    404: "Unknown model.",
    413: "Request body over the size limit.",
    429: "Too many background responses are being answered; poll or cancel some first.",
    500: "Internal server error.",
    503: "The model is loading, the server is draining, or the engine failed.",
}
_BODY_ERRORS = (400, 401, 404, 413, 500, 503)  # every route that reads a JSON body and reaches the engine


@dataclass(frozen=True)
class Operation:
    """One (path, method) the app serves and what it reads and writes.

    `request` lists the body models a client may send (more than one: any of them); `response` is the
    model of a 200 JSON body; `content` replaces it for answers no model describes (plain text, an empty
    body, a one-field object); `streams` adds the text/event-stream answer of `"stream": true`.
    """

    path: str
    method: str
    operation_id: str
    summary: str
    tag: str
    request: tuple[type[BaseModel], ...] = ()
    response: type[BaseModel] | tuple[type[BaseModel], ...] | None = None  # a tuple: one of them
    content: dict[str, Any] | None = None
    streams: type[BaseModel] | None = None  # the model of each `data:` event
    errors: tuple[int, ...] = ()
    guarded: bool = False  # behind --api-key (middleware.py's guarded prefixes)
    path_params: tuple[str, ...] = ()  # the `{name}` parts of `path`, each a string
    query: type[BaseModel] | None = None  # the query's model: each field an optional parameter
    # How a stream ends, when it is not chat's way (`data: [DONE]`): the Responses API's typed events.
    stream_format: str | None = None
    extra_responses: dict[str, Any] = field(default_factory=dict)


_HEALTH_RESPONSES = {"503": {"description": "Loading, draining, or the engine failed (empty body)."}}
_JSON_OBJECT = "application/json"
_TEXT = {"text/plain": {"schema": {"type": "string"}}}

OPERATIONS: tuple[Operation, ...] = (
    Operation("/v1/completions", "post", "create_completion", "Create a completion", "OpenAI",
              request=(CompletionRequest,), response=CompletionResponse, streams=CompletionResponse,
              errors=_BODY_ERRORS, guarded=True),
    Operation("/v1/chat/completions", "post", "create_chat_completion", "Create a chat completion", "OpenAI",
              request=(ChatCompletionRequest,), response=ChatCompletionResponse, streams=ChatCompletionChunk,
              errors=_BODY_ERRORS, guarded=True),
    Operation("/v1/embeddings", "post", "create_embedding", "Create embeddings (a --runner pooling server)",
              "OpenAI", request=(EmbeddingRequest, EmbeddingChatRequest), response=EmbeddingResponse,
              errors=_BODY_ERRORS, guarded=True),
    Operation("/classify", "post", "create_classification", "Classify texts, token ids or a chat with a "
              "classifier model (vLLM; a --runner pooling server, which a classifier chooses)", "vLLM",
              request=(ClassificationRequest, ClassificationChatRequest), response=ClassificationResponse,
              errors=_BODY_ERRORS, guarded=True),
    *(Operation(path, "post", f"create_score{path.replace('/', '_')}", "Score text pairs by their embeddings' "
                "cosine similarity, or by a cross-encoder (vLLM; a --runner pooling server)", "vLLM",
                request=(ScoreRequest,),
                response=ScoreResponse, errors=_BODY_ERRORS, guarded=True) for path in SCORE_PATHS),
    *(Operation(path, "post", f"create_rerank{path.replace('/', '_')}", "Rank documents by their relevance to a "
                "query (vLLM, Jina and Cohere's shape; a --runner pooling server)", "vLLM", request=(RerankRequest,),
                response=RerankResponse, errors=_BODY_ERRORS, guarded=True) for path in RERANK_PATHS),
    Operation("/v1/responses", "post", "create_response", "Create a response (the Responses API, text subset)",
              "OpenAI", request=(ResponsesRequest,), response=ResponseObject, streams=ResponseEvent,
              errors=(*_BODY_ERRORS, 429), guarded=True, stream_format=(
                  ' With "stream": true, server-sent events `event: <type>` / `data: <ResponseEvent JSON>`: '
                  "response.created, response.in_progress, each output item's events, then response.completed "
                  "(response.incomplete when cut by max_output_tokens; error and response.failed if the engine "
                  "fails mid-stream).")),
    Operation("/v1/responses/{response_id}", "get", "retrieve_response", "A stored response; a background one "
              "as it stands (queued, in_progress, then completed, incomplete, failed or cancelled)", "OpenAI",
              response=ResponseObject, streams=ResponseEvent, errors=(400, 401, 404, 503), guarded=True,
              path_params=("response_id",), query=ResponseQuery,
              stream_format=' With stream=true (a background response created with "stream": true): its '
                            "events after starting_after, then each as it comes, as POST /v1/responses streams them."),
    Operation("/v1/responses/{response_id}", "delete", "delete_response", "Forget a stored response (a "
              "background one that runs is cancelled first)", "OpenAI", response=ResponseDeleted,
              errors=(401, 404, 503), guarded=True, path_params=("response_id",)),
    Operation("/v1/responses/{response_id}/cancel", "post", "cancel_response", "Cancel a background response "
              "that runs; one that ended is answered as it ended", "OpenAI", response=ResponseObject,
              errors=(400, 401, 404, 503), guarded=True, path_params=("response_id",)),
    Operation("/v1/responses/{response_id}/input_items", "get", "list_input_items", "The input items a stored "
              "response was asked with, a page at a time", "OpenAI", response=ResponseItemList,
              errors=(400, 401, 404, 503), guarded=True, path_params=("response_id",), query=InputItemsQuery),
    Operation("/invocations", "post", "invocations", "SageMaker's inference route (vLLM's): a body with messages is "
              "answered as /v1/chat/completions, one with prompt as /v1/completions; on a --runner pooling server "
              "query and documents as /v1/rerank, text_1 or text_2 as /v1/score, input or messages as "
              "/v1/embeddings (as /classify on a classifier's)", "vLLM",
              request=(ChatCompletionRequest, CompletionRequest, EmbeddingRequest, EmbeddingChatRequest,
                       ScoreRequest, RerankRequest, ClassificationRequest, ClassificationChatRequest),
              response=(ChatCompletionResponse, CompletionResponse, EmbeddingResponse, ScoreResponse, RerankResponse,
                        ClassificationResponse),
              streams=ChatCompletionChunk, errors=_BODY_ERRORS, guarded=True, stream_format=(
                  ' With "stream": true, the server-sent events of the endpoint the body picks.')),
    Operation("/v1/models", "get", "list_models", "List the served models", "OpenAI",
              response=ModelList, errors=(401, 503), guarded=True),
    Operation("/v1/models/{model_id}", "get", "retrieve_model", "One served model (its id may hold slashes)",
              "OpenAI", response=ModelCard, errors=(401, 404, 503), guarded=True, path_params=("model_id",)),
    Operation("/tokenize", "post", "tokenize", "Tokenize a prompt or a chat (vLLM)", "vLLM",
              request=(TokenizeCompletionRequest, TokenizeChatRequest), response=TokenizeResponse,
              errors=_BODY_ERRORS, guarded=True),
    Operation("/detokenize", "post", "detokenize", "Detokenize token ids (vLLM)", "vLLM",
              request=(DetokenizeRequest,), response=DetokenizeResponse, errors=_BODY_ERRORS, guarded=True),
    Operation("/health", "get", "health", "Liveness and readiness: 200 once the model serves", "Server",
              content={}, extra_responses=_HEALTH_RESPONSES),
    Operation("/ping", "get", "ping", "Same as /health (SageMaker's name)", "Server",
              content={}, extra_responses=_HEALTH_RESPONSES),
    Operation("/ping", "post", "ping_post", "Same as /health (SageMaker's name)", "Server",
              content={}, extra_responses=_HEALTH_RESPONSES),
    Operation("/load", "get", "load", "Requests in flight, for load balancers", "Server",
              content={_JSON_OBJECT: {"schema": {
                  "type": "object", "required": ["server_load"],
                  "properties": {"server_load": {"type": "integer", "minimum": 0,
                                                 "description": "HTTP requests being served now, and "
                                                                "background responses being answered."}}}}}),
    Operation("/version", "get", "version", "The jaxserve version", "Server",
              content={_JSON_OBJECT: {"schema": {
                  "type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}}}),
    Operation("/metrics", "get", "metrics", "Prometheus metrics (jaxserve:*, named after vLLM's vllm:*)",
              "Server", content=_TEXT),
)
# Served where the server allows runtime LoRA updates (`ServerConfig.allow_runtime_lora_updating`).
LORA_OPERATIONS: tuple[Operation, ...] = (
    Operation("/v1/load_lora_adapter", "post", "load_lora_adapter", "Serve a PEFT LoRA adapter from a directory "
              "on the server as a model of its own (vLLM; --enable-lora)", "vLLM", request=(LoadLoraAdapterRequest,),
              content=_TEXT, errors=_BODY_ERRORS, guarded=True),
    Operation("/v1/unload_lora_adapter", "post", "unload_lora_adapter", "Stop serving a LoRA adapter (vLLM)", "vLLM",
              request=(UnloadLoraAdapterRequest,), content=_TEXT, errors=_BODY_ERRORS, guarded=True),
)


# Served where the server has a profiler folder (`ServerConfig.profiler_dir`).
PROFILE_OPERATIONS: tuple[Operation, ...] = (
    Operation("/start_profile", "post", "start_profile", "Start recording a jax.profiler trace of the engine into "
              "the server's --profiler-dir (vLLM)", "vLLM", content={}, errors=(400, 401, 500, 503), guarded=True),
    Operation("/stop_profile", "post", "stop_profile", "Stop the trace and write it (XProf / TensorBoard and "
              "Perfetto files) (vLLM)", "vLLM", content={}, errors=(400, 401, 500, 503), guarded=True),
)


def served_operations(config: ServerConfig) -> tuple[Operation, ...]:
    return (OPERATIONS + (LORA_OPERATIONS if config.allow_runtime_lora_updating else ())
            + (PROFILE_OPERATIONS if config.profiler_dir is not None else ()))


def _component_schemas() -> tuple[dict[str, Any], dict[tuple[type[BaseModel], JsonSchemaMode], dict[str, Any]]]:
    """components.schemas for every model OPERATIONS names, and the `$ref` of each (model, mode).

    Request bodies use pydantic's validation schema (what it accepts: defaults optional) and responses
    its serialization schema (what it emits); pydantic names the two apart only where they differ.
    """
    wanted: dict[tuple[type[BaseModel], JsonSchemaMode], None] = {}
    for op in OPERATIONS + LORA_OPERATIONS:
        wanted.update({(model, "validation"): None for model in op.request})
        wanted.update({(model, "serialization"): None for model in (*_responses(op), op.streams) if model})
    wanted[(ErrorResponse, "serialization")] = None
    refs, schema = models_json_schema(list(wanted), ref_template=REF_TEMPLATE)
    return schema.get("$defs", {}), refs


def _responses(op: Operation) -> tuple[type[BaseModel], ...]:
    return op.response if isinstance(op.response, tuple) else (op.response,) if op.response else ()


def _operation(op: Operation, refs: dict, secured: bool) -> dict[str, Any]:
    """The operation object; `secured`: this server checks a key on this route."""
    doc: dict[str, Any] = {"operationId": op.operation_id, "summary": op.summary, "tags": [op.tag]}
    parameters = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                  for name in op.path_params]
    if op.query is not None:
        fields = op.query.model_json_schema()["properties"]
        parameters += [{"name": name, "in": "query", "required": False, "schema": schema}
                       for name, schema in fields.items()]
    if parameters:
        doc["parameters"] = parameters
    if op.request:
        bodies = [refs[(model, "validation")] for model in op.request]
        doc["requestBody"] = {"required": True, "content": {_JSON_OBJECT: {
            "schema": bodies[0] if len(bodies) == 1 else {"anyOf": bodies}}}}
    if models := _responses(op):
        schemas = [refs[(model, "serialization")] for model in models]
        content: dict[str, Any] = {_JSON_OBJECT: {"schema": schemas[0] if len(schemas) == 1 else {"anyOf": schemas}}}
        description = f"A {' or '.join(model.__name__ for model in models)}."
        if op.streams is not None:
            content["text/event-stream"] = {"schema": {"type": "string"}}
            description += op.stream_format or (
                f' With "stream": true, server-sent events: one `data: <{op.streams.__name__} JSON>` per chunk,'
                " `data: <ErrorResponse JSON>` if the request fails mid-stream, then `data: [DONE]`.")
        ok: dict[str, Any] = {"description": description, "content": content}
    else:
        ok = {"description": "OK", **({"content": op.content} if op.content else {})}
    responses: dict[str, Any] = {"200": ok, **op.extra_responses}
    for status in op.errors:
        if status == 401 and not secured:
            continue
        responses[str(status)] = {"description": _ERROR_MEANINGS[status],
                                  "content": {_JSON_OBJECT: {"schema": refs[(ErrorResponse, "serialization")]}}}
    doc["responses"] = responses
    if secured:
        doc["security"] = [{"bearer": []}]
    return doc


def openapi_document(config: ServerConfig) -> dict[str, Any]:
    """The whole document, less `servers` (which depends on where a proxy mounts the app)."""
    schemas, refs = _component_schemas()
    paths: dict[str, dict[str, Any]] = {}
    for op in served_operations(config):
        secured = config.api_key is not None and op.guarded
        paths.setdefault(op.path, {})[op.method] = _operation(op, refs, secured)
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "jaxserve",
            "version": __version__,
            "description": "OpenAI-compatible completions and chat, with vLLM's sampling extras and endpoints.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            # Declared always, so clients see how a key is sent; applied to the guarded routes only
            # when this server was started with --api-key.
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "--api-key (or JAXSERVE_API_KEY)."}},
        },
    }


def _root_path(request: Request, config: ServerConfig) -> str:
    """Where a proxy mounts the app: the ASGI server's root_path (Hypercorn sets it from --root-path)."""
    return (request.scope.get("root_path") or config.root_path).rstrip("/")


_SWAGGER_HTML = """<!DOCTYPE html>
<html>
<head>
<meta charset="utf-8">
<title>jaxserve - Swagger UI</title>
<link rel="stylesheet" href="{cdn}/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{cdn}/swagger-ui-bundle.js"></script>
<script>
SwaggerUIBundle({{url: {url}, dom_id: "#swagger-ui", deepLinking: true,
                  presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
                  layout: "BaseLayout"}});
</script>
</body>
</html>
"""


def openapi_routes(config: ServerConfig) -> list[Route]:
    """Routes for /openapi.json and /docs (none with --disable-fastapi-docs). The document is built once:
    the models never change."""
    if config.disable_fastapi_docs:
        return []
    document = openapi_document(config)

    async def openapi_json(request: Request) -> Response:
        return JSONResponse({**document, "servers": [{"url": _root_path(request, config) or "/"}]})

    async def docs(request: Request) -> Response:
        # json.dumps quotes the URL for JavaScript; escaping "<" keeps a root path from closing <script>.
        url = json.dumps(f"{_root_path(request, config)}/openapi.json").replace("<", "\\u003c")
        return HTMLResponse(_SWAGGER_HTML.format(cdn=SWAGGER_UI_CDN, url=url))

    return [
        Route("/openapi.json", openapi_json, methods=["GET"], include_in_schema=False),
        Route("/docs", docs, methods=["GET"], include_in_schema=False),
    ]
