"""GET /v1/models, /v1/models/{model}, /health, /ping, /load, /version, /metrics; POST /tokenize, /detokenize
(vLLM's shapes)."""

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve import __version__
from jaxserve.api.chat import render_chat
from jaxserve.api.errors import APIError, validate
from jaxserve.api.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from jaxserve.api.serving import ServerState, get_serving, model_not_found


def _model_cards(request: Request) -> list[ModelCard]:
    """The served model under each of its names, then each LoRA adapter served as a model of its own."""
    serving = get_serving(request)
    cards = [ModelCard(id=name, created=serving.created, root=serving.info.model_root,
                       max_model_len=serving.max_model_len) for name in serving.model_names]
    cards += [ModelCard(id=adapter.name, created=serving.created, root=adapter.path,
                        parent=adapter.base_model_name or serving.model_names[0], max_model_len=serving.max_model_len)
              for adapter in serving.engine.lora_modules]
    return cards


async def list_models(request: Request) -> Response:
    return JSONResponse(ModelList(data=_model_cards(request)).model_dump())


async def retrieve_model(request: Request) -> Response:
    """One served model's card (OpenAI's `models.retrieve`); its id may hold slashes (a hub name). No id
    (`/v1/models/`) is the list."""
    if not (model_id := request.path_params["model_id"]):
        return await list_models(request)
    for card in _model_cards(request):
        if card.id == model_id:
            return JSONResponse(card.model_dump())
    raise model_not_found(model_id)


async def health(request: Request) -> Response:
    """200 once the model is loaded and the engine runs; 503 while loading, after a failure, or draining.
    /ping (SageMaker's name, served by vLLM too) answers the same."""
    state: ServerState = request.app.state.server
    return Response(status_code=200 if state.is_healthy else 503)


async def load(request: Request) -> Response:
    """How many API requests are in flight (vLLM's /load), background responses being answered among them,
    for load-aware routing."""
    state: ServerState = request.app.state.server
    background = state.serving.responses.num_running if state.serving is not None else 0
    return JSONResponse({"server_load": state.num_in_flight + background})


async def version(request: Request) -> Response:
    return JSONResponse({"version": __version__})


async def metrics(request: Request) -> Response:
    serving = request.app.state.server.serving
    body = generate_latest(serving.metrics.registry) if serving is not None else b""
    return Response(body, media_type=CONTENT_TYPE_LATEST)


async def tokenize(request: Request) -> Response:
    serving = get_serving(request)
    data = await serving.read_json(request)
    req: TokenizeChatRequest | TokenizeCompletionRequest
    if isinstance(data, dict) and "messages" in data:
        req = validate(TokenizeChatRequest, data)
        serving.check_model(req.model)
        tools = [tool.model_dump(exclude_none=True) for tool in req.tools] if req.tools else None
        tokens = await render_chat(serving, req.messages, req.add_generation_prompt, req.continue_final_message,
                                   req.chat_template, req.chat_template_kwargs, tools, documents=req.documents,
                                   add_special_tokens=req.add_special_tokens, reasoning_effort=req.reasoning_effort)
    else:
        req = validate(TokenizeCompletionRequest, data)
        serving.check_model(req.model)
        tokens = await serving.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    strings = await serving.off_loop(serving.tokenizer.convert_ids_to_tokens, tokens) if req.return_token_strs \
        else None
    return JSONResponse(TokenizeResponse(count=len(tokens), max_model_len=serving.max_model_len, tokens=tokens,
                                         token_strs=strings).model_dump())


async def detokenize(request: Request) -> Response:
    serving = get_serving(request)
    req = await serving.parse(request, DetokenizeRequest)
    serving.check_model(req.model)
    bad = next((t for t in req.tokens if not 0 <= t < serving.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary [0, {serving.vocab_size})", "tokens")
    return JSONResponse(DetokenizeResponse(prompt=await serving.decode(req.tokens)).model_dump())
