"""POST /v1/chat/completions: the chat template turns messages into one prompt with n completions."""

import time
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxserve.api.errors import APIError, parse_body
from jaxserve.api.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    random_id,
)
from jaxserve.api.serving import ModelServing, engine_error, get_serving, sse_error, unless_disconnected
from jaxserve.engine.async_engine import EngineDeadError
from jaxserve.outputs import CompletionOutput, RequestOutput


def _message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them, with content parts joined into text."""
    result = []
    for i, message in enumerate(messages):
        data = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            texts = []
            for part in message.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"content part of type {part.get('type')!r} is not supported; "
                                        "only text", f"messages.{i}.content")
                texts.append(part["text"])
            data["content"] = "\n".join(texts)
        result.append(data)
    return result


def render_chat(
    serving: ModelServing,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The conversation rendered by the chat template and tokenized (the template adds special tokens)."""
    if not messages:
        raise APIError(400, "messages must not be empty", "messages")
    if continue_final_message and add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true")
    try:
        text = serving.tokenizer.apply_chat_template(
            _message_dicts(messages),
            chat_template=chat_template or serving.chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(chat_template_kwargs or {}),
        )
    except (jinja2.TemplateError, ValueError, TypeError) as e:
        raise APIError(400, f"the chat template could not render these messages: {e}", "messages") from None
    ids = serving.tokenizer.encode(text, add_special_tokens=False)
    serving.check_prompt(ids)
    return ids


def _logprobs(serving: ModelServing, completion: CompletionOutput, start: int) -> ChatLogprobs:
    content = []
    top = completion.top_logprobs or []
    for i in range(start, len(completion.token_ids)):
        token = serving.token_string(completion.token_ids[i])
        alternatives = [
            TopLogprob(token=(s := serving.token_string(t)), logprob=lp, bytes=list(s.encode()))
            for t, lp in (top[i].items() if top else ())
        ]
        content.append(TokenLogprob(token=token, logprob=completion.logprobs[i], bytes=list(token.encode()),
                                    top_logprobs=alternatives))
    return ChatLogprobs(content=content)


async def create_chat_completion(request: Request) -> Response:
    serving = get_serving(request)
    req = await parse_body(request, ChatCompletionRequest, serving.config.max_request_body_bytes)
    serving.check_model(req.model)
    if req.response_format is not None and req.response_format.type != "text":
        raise APIError(400, f"response_format {req.response_format.type!r} is not supported yet; only 'text'",
                       "response_format")
    if req.tools:
        raise APIError(400, "tools are not supported yet", "tools")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
    prompt_ids = render_chat(serving, req.messages, req.add_generation_prompt, req.continue_final_message,
                             req.chat_template, req.chat_template_kwargs)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = serving.sampling_params(req, len(prompt_ids), max_tokens, logprobs)
    serving.validate(prompt_ids, params)
    request_id = random_id("chatcmpl")
    model_name = req.model or serving.model_names[0]
    outputs = serving.generate(prompt_ids, params, request_id)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(serving, req, request_id, model_name, outputs, include_usage)
        return StreamingResponse(body, media_type="text/event-stream")
    try:
        final = await unless_disconnected(request, _last(outputs))
    except (ValueError, EngineDeadError) as e:
        raise engine_error(e) from None
    choices = [
        ChatChoice(
            index=c.index,
            message=ChatResponseMessage(content=c.text),
            logprobs=_logprobs(serving, c, 0) if req.logprobs else None,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in final.outputs
    ]
    usage = UsageInfo.of(len(prompt_ids), final.num_generated_tokens)
    return JSONResponse(ChatCompletionResponse(id=request_id, model=model_name, choices=choices,
                                               usage=usage).model_dump())


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async for output in outputs:
        final = output
    return final


async def _stream(
    serving: ModelServing,
    req: ChatCompletionRequest,
    request_id: str,
    model_name: str,
    outputs: AsyncIterator[RequestOutput],
    include_usage: bool,
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        response = ChatCompletionChunk(id=request_id, created=created, model=model_name, choices=choices,
                                       usage=usage)
        return f"data: {response.model_dump_json()}\n\n"

    sent_tokens = [0] * req.n
    finished: set[int] = set()
    try:
        for i in range(req.n):  # the first chunk of each choice carries the role
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        last = None
        async for output in outputs:
            last = output
            for completion in output.outputs:
                i = completion.index
                if i in finished or not (completion.text_delta or completion.finished
                                         or len(completion.token_ids) > sent_tokens[i]):
                    continue
                logprobs = _logprobs(serving, completion, sent_tokens[i]) if req.logprobs else None
                sent_tokens[i] = len(completion.token_ids)
                if completion.finished:
                    finished.add(i)
                yield chunk([ChatChunkChoice(
                    index=i, delta=DeltaMessage(content=completion.text_delta), logprobs=logprobs,
                    finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                )])
        if include_usage and last is not None:
            yield chunk([], UsageInfo.of(last.num_prompt_tokens, last.num_generated_tokens))
    except (ValueError, EngineDeadError) as e:
        yield sse_error(e)
    yield "data: [DONE]\n\n"
