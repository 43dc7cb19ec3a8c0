"""POST /v1/embeddings: each input embedded by a `--runner pooling` engine (one engine request per input,
batched by the scheduler like any prompt), normalized, cut to `dimensions` for matryoshka models, and
sent as floats or base64. A body with `messages` instead of `input` is vLLM's chat embeddings request: the
conversation rendered by the chat template, as /v1/chat/completions renders it, and embedded as one input."""

import base64

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.api.chat import render_chat
from jaxserve.api.errors import APIError, validate
from jaxserve.api.protocol import (
    ClassificationChatRequest,
    ClassificationRequest,
    EmbeddingChatRequest,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    random_id,
)
from jaxserve.api.serving import ModelServing, get_serving
from jaxserve.api.streaming import collect
from jaxserve.engine.scoring import finish_embedding
from jaxserve.sampling_params import POOLING_PARAMS, InvalidParam, check_priority

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
# What the engine's limits name when a prompt to embed does not fit: the prompt, or the one token a pooling
# request "generates" (POOLING_PARAMS), which no client sets; either way the text is at fault
_PROMPT_PARAMS = ("prompt", "max_tokens")


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


async def prompt_inputs(serving: ModelServing, req: EmbeddingRequest | EmbeddingChatRequest | ClassificationRequest
                        | ClassificationChatRequest) -> list[list[int]]:
    """A request's inputs (texts, token ids, or a conversation) as prompts, each checked (`check_pooled_prompt`)."""
    serving.check_truncation(req.truncate_prompt_tokens)
    if isinstance(req, EmbeddingChatRequest | ClassificationChatRequest):
        ids = await render_chat(serving, req.messages, req.add_generation_prompt, req.continue_final_message,
                                req.chat_template, req.chat_template_kwargs, None, req.truncate_prompt_tokens,
                                add_special_tokens=req.add_special_tokens)
        check_pooled_prompt(serving, ids, "messages")
        return [ids]
    items = req.input
    if isinstance(items, str) or (items and all(isinstance(t, int) for t in items)):
        items = [items]
    if not items:
        raise APIError(400, "input must not be empty", "input")
    if len(items) > MAX_INPUTS:
        raise APIError(400, f"at most {MAX_INPUTS} inputs per request, got {len(items)}", "input")
    result = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise APIError(400, "an input string must not be empty", "input")
            ids = await serving.encode(item, req.add_special_tokens, req.truncate_prompt_tokens)
        else:
            ids = serving.truncate(list(item), req.truncate_prompt_tokens)
        check_pooled_prompt(serving, ids, "input")
        result.append(ids)
    return result


def check_pooled_prompt(serving: ModelServing, ids: list[int], param: str) -> None:
    """A 400 naming `param` for a prompt the engine cannot embed (empty, over the context, ids outside the
    vocabulary)."""
    try:
        serving.info.limits.check(ids, POOLING_PARAMS, pooled=True)
    except InvalidParam as e:
        raise APIError(400, str(e), param if e.param in _PROMPT_PARAMS else e.param) from None


def check_pooling(serving: ModelServing, what: str) -> None:
    """A 400 unless the server embeds (`--runner pooling`): `what` ("embeddings", "scores") needs it."""
    if serving.info.runner != "pooling":
        raise APIError(400, f"this server generates text: {what} need a server started with --runner pooling",
                       "model")


def check_classifier(serving: ModelServing, wanted: bool) -> None:
    """A 400 unless the model is a classifier (`wanted`) or is not one: a classifier's pooled vectors are its
    classes' logits, which /classify reads, and which are no embeddings."""
    classes = len(serving.info.class_labels)
    if wanted and not classes:
        raise APIError(400, "this model has no classifier head: classifications need a model whose architecture "
                            "ends in ForSequenceClassification", "model")
    if not wanted and classes:
        raise APIError(400, f"this model is a classifier ({classes} classes): its outputs are class logits, not "
                            "embeddings; use /classify, /score or /rerank", "model")


async def pooled(serving: ModelServing, request: Request, prompts: list[list[int]], priority: int,
                 request_id: str) -> list[list[float]]:
    """Each prompt's pooled final hidden state, in order, one engine request each (batched by the scheduler);
    the prompts were checked by `check_pooled_prompt`."""
    try:
        check_priority(priority, serving.info.scheduling_policy)
    except InvalidParam as e:
        raise APIError(400, str(e), e.param) from None
    streams = [serving.generate(ids, POOLING_PARAMS, f"{request_id}-{i}", priority=priority)
               for i, ids in enumerate(prompts)]
    return [out.embedding for out in await collect(request, streams)]


async def read_pooling_request(serving: ModelServing, request: Request, inputs: type, chat: type, verb: str):
    """The body as `inputs` (texts or token ids) or, where it holds `messages`, as `chat`; a 400 for one with
    both ("a request `verb` one or the other"), or for what the model's validation refuses."""
    data = await serving.read_json(request)
    is_chat = isinstance(data, dict) and "messages" in data
    if is_chat and "input" in data:
        raise APIError(400, f"input or messages: a request {verb} one or the other", "messages")
    req = validate(chat if is_chat else inputs, data)
    serving.check_model(req.model)
    return req


async def create_embedding(request: Request) -> Response:
    serving = get_serving(request)
    check_pooling(serving, "embeddings")
    check_classifier(serving, False)
    req = await read_pooling_request(serving, request, EmbeddingRequest, EmbeddingChatRequest, "embeds")
    if req.dimensions is not None:
        if not serving.matryoshka:
            raise APIError(400, "dimensions: this model's embeddings are not matryoshka representations; cutting "
                                "them short would make them worse", "dimensions")
        if not 1 <= req.dimensions <= serving.info.hidden_size:
            raise APIError(400, f"dimensions must be in [1, {serving.info.hidden_size}], got {req.dimensions}",
                           "dimensions")
    prompts = await prompt_inputs(serving, req)
    request_id = random_id("embd")
    vectors = await pooled(serving, request, prompts, req.priority, request_id)
    data = [EmbeddingData(index=i, embedding=_encode(finish_embedding(vector, req.dimensions, req.normalize),
                                                     req.encoding_format))
            for i, vector in enumerate(vectors)]
    num_tokens = sum(len(ids) for ids in prompts)
    return JSONResponse(EmbeddingResponse(id=request_id, model=req.model or serving.model_names[0], data=data,
                                          usage=EmbeddingUsage(prompt_tokens=num_tokens,
                                                               total_tokens=num_tokens)).model_dump())
