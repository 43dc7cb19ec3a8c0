"""POST /v1/completions: one engine request per prompt (each with its n completions), streamed or not."""

from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxserve.api.errors import APIError
from jaxserve.api.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from jaxserve.api.serving import ModelServing, get_serving
from jaxserve.api.streaming import ChoiceStream, collect, sse
from jaxserve.outputs import CompletionOutput

MAX_SEQUENCES_PER_REQUEST = 1024  # prompts x n: one HTTP request may not queue unbounded work


async def _prompts(serving: ModelServing, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """(prompt text or None, prompt token ids) for each prompt in the request's four accepted shapes."""
    prompt = req.prompt
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]  # one prompt of token ids
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt must not be empty", "prompt")
    if len(items) * req.n > MAX_SEQUENCES_PER_REQUEST:
        raise APIError(400, f"{len(items)} prompts x n={req.n} exceed the limit of {MAX_SEQUENCES_PER_REQUEST} "
                            "completions per request", "prompt")
    return [(item, await serving.encode(item) if item else []) if isinstance(item, str) else (None, list(item))
            for item in items]


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
    req = await serving.parse(request, CompletionRequest)
    serving.check_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (it must equal n when given)", "best_of")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs needs prompt logprobs, which are not supported yet", "echo")
    prompts = await _prompts(serving, req)
    # Every prompt is checked before any starts, so a bad one is a 400 even when streaming.
    params = [serving.sampling_params(req, ids, req.max_tokens, req.logprobs) for _, ids in prompts]
    if req.echo:
        prompts = [(text if text is not None else await serving.decode(ids), ids) for text, ids in prompts]
    request_id = random_id("cmpl")
    streams = [serving.generate(ids, p, f"{request_id}-{i}") for i, ((_, ids), p) in enumerate(zip(prompts, params,
                                                                                                  strict=True))]
    choices = ChoiceStream(streams, req.n, sum(len(ids) for _, ids in prompts))
    model_name = req.model or serving.model_names[0]
    if req.stream:
        def chunk(items: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
            return CompletionResponse(id=request_id, model=model_name, choices=items, usage=usage)

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = sse(_chunks(serving, req, prompts, choices, chunk),
                   (lambda: chunk([], choices.usage)) if include_usage else None)
        return StreamingResponse(body, media_type="text/event-stream")
    finals = await collect(request, streams)
    items, num_generated = [], 0
    for prompt_index, output in enumerate(finals):
        prompt_text = prompts[prompt_index][0] or ""
        for completion in output.outputs:
            num_generated += len(completion.token_ids)
            items.append(CompletionChoice(
                index=prompt_index * req.n + completion.index,
                text=(prompt_text if req.echo else "") + completion.text,
                logprobs=_logprobs(serving, completion, 0, 0) if req.logprobs is not None else None,
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            ))
    usage = UsageInfo.of(choices.num_prompt_tokens, num_generated)
    return JSONResponse(CompletionResponse(id=request_id, model=model_name, choices=items, usage=usage).model_dump())


async def _chunks(
    serving: ModelServing,
    req: CompletionRequest,
    prompts: list[tuple[str | None, list[int]]],
    choices: ChoiceStream,
    chunk: Callable[[list[CompletionChoice]], CompletionResponse],
) -> AsyncIterator[CompletionResponse]:
    if req.echo:
        yield chunk([CompletionChoice(index=i, text=prompts[i // req.n][0] or "")
                     for i in range(len(prompts) * req.n)])
    text_offsets = [0] * (len(prompts) * req.n)
    async for delta in choices:
        logprobs = None
        if req.logprobs is not None:
            logprobs = _logprobs(serving, delta.completion, delta.first_token, text_offsets[delta.index])
            text_offsets[delta.index] += sum(len(t) for t in logprobs.tokens)
        yield chunk([CompletionChoice(
            index=delta.index, text=delta.completion.text_delta, logprobs=logprobs,
            finish_reason=delta.finish_reason, stop_reason=delta.completion.stop_reason,
        )])
