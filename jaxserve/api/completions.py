"""POST /v1/completions: one engine request per prompt (each with its n completions), streamed or not."""

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxserve.api.errors import APIError, parse_body
from jaxserve.api.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from jaxserve.api.serving import ModelServing, engine_error, get_serving, merge_streams, sse_error, unless_disconnected
from jaxserve.engine.async_engine import EngineDeadError
from jaxserve.outputs import CompletionOutput, RequestOutput


def _prompts(serving: ModelServing, req: CompletionRequest) -> list[tuple[str, list[int]]]:
    """(prompt text, prompt token ids) for each prompt in the request's four accepted shapes."""
    prompt = req.prompt
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]  # one prompt of token ids
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt must not be empty", "prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            ids = serving.tokenizer.encode(item) if item else []
            serving.check_prompt(ids)
            prompts.append((item, ids))
        else:
            serving.check_prompt(item)
            prompts.append((serving.tokenizer.decode(item), list(item)))
    return prompts


def _logprobs(serving: ModelServing, completion: CompletionOutput, start: int, text_offset: int) -> CompletionLogprobs:
    """Logprobs of the completion's tokens from index `start` on, in the legacy completions shape."""
    result = CompletionLogprobs()
    top = completion.top_logprobs or []
    for i in range(start, len(completion.token_ids)):
        token = serving.token_string(completion.token_ids[i])
        result.tokens.append(token)
        result.token_logprobs.append(completion.logprobs[i])
        result.text_offset.append(text_offset)
        text_offset += len(token)
        if top:
            result.top_logprobs.append({serving.token_string(t): lp for t, lp in top[i].items()})
        else:
            result.top_logprobs.append(None)
    return result


async def create_completion(request: Request) -> Response:
    serving = get_serving(request)
    req = await parse_body(request, CompletionRequest, serving.config.max_request_body_bytes)
    serving.check_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (it must equal n when given)", "best_of")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs needs prompt logprobs, which are not supported yet", "echo")
    prompts = _prompts(serving, req)
    params = [serving.sampling_params(req, len(ids), req.max_tokens, req.logprobs) for _, ids in prompts]
    request_id = random_id("cmpl")
    prompt_ids = [ids for _, ids in prompts]
    for ids, p in zip(prompt_ids, params, strict=True):
        serving.validate(ids, p)  # all prompts before any starts
    streams = [serving.generate(ids, p, f"{request_id}-{i}") for i, (ids, p) in enumerate(zip(prompt_ids, params,
                                                                                               strict=True))]
    model_name = req.model or serving.model_names[0]
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(serving, req, request_id, model_name, prompts, streams, include_usage)
        return StreamingResponse(body, media_type="text/event-stream")
    try:
        finals = await unless_disconnected(request, _collect(streams, len(prompts)))
    except (ValueError, EngineDeadError) as e:
        raise engine_error(e) from None
    choices, num_generated = [], 0
    for prompt_index, output in enumerate(finals):
        prompt_text = prompts[prompt_index][0]
        for completion in output.outputs:
            num_generated += len(completion.token_ids)
            choices.append(CompletionChoice(
                index=prompt_index * req.n + completion.index,
                text=(prompt_text if req.echo else "") + completion.text,
                logprobs=_logprobs(serving, completion, 0, 0) if req.logprobs is not None else None,
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            ))
    num_prompt = sum(len(ids) for _, ids in prompts)
    usage = UsageInfo.of(num_prompt, num_generated)
    response = CompletionResponse(id=request_id, model=model_name, choices=choices, usage=usage)
    return JSONResponse(response.model_dump())


async def _collect(streams: list[AsyncIterator[RequestOutput]], num_prompts: int) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * num_prompts
    async for index, output in merge_streams(streams):
        if output.finished:
            finals[index] = output
    return finals


async def _stream(
    serving: ModelServing,
    req: CompletionRequest,
    request_id: str,
    model_name: str,
    prompts: list[tuple[str, list[int]]],
    streams: list[AsyncIterator[RequestOutput]],
    include_usage: bool,
) -> AsyncIterator[str]:
    def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        response = CompletionResponse(id=request_id, model=model_name, choices=choices, usage=usage)
        return f"data: {response.model_dump_json()}\n\n"

    num_choices = len(prompts) * req.n
    sent_tokens = [0] * num_choices
    text_offsets = [0] * num_choices
    finished: set[int] = set()
    num_generated = 0
    try:
        if req.echo:
            yield chunk([CompletionChoice(index=i, text=prompts[i // req.n][0]) for i in range(num_choices)])
        async for prompt_index, output in merge_streams(streams):
            for completion in output.outputs:
                index = prompt_index * req.n + completion.index
                if index in finished or not (completion.text_delta or completion.finished
                                             or len(completion.token_ids) > sent_tokens[index]):
                    continue
                logprobs = None
                if req.logprobs is not None:
                    logprobs = _logprobs(serving, completion, sent_tokens[index], text_offsets[index])
                    text_offsets[index] += sum(len(t) for t in logprobs.tokens)
                num_generated += len(completion.token_ids) - sent_tokens[index]
                sent_tokens[index] = len(completion.token_ids)
                if completion.finished:
                    finished.add(index)
                yield chunk([CompletionChoice(
                    index=index, text=completion.text_delta, logprobs=logprobs,
                    finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                )])
        if include_usage:
            num_prompt = sum(len(ids) for _, ids in prompts)
            yield chunk([], UsageInfo.of(num_prompt, num_generated))
    except (ValueError, EngineDeadError) as e:
        yield sse_error(e)
    yield "data: [DONE]\n\n"
