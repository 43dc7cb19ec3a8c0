"""POST /v1/completions: one engine request per prompt (each with its n completions), streamed or not."""

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from jaxserve.api.beam_search import beam_search, beam_search_params, side_by_side
from jaxserve.api.errors import APIError
from jaxserve.api.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from jaxserve.api.serving import ModelServing, get_serving, logprob_token_ids, num_logprobs, request_ids
from jaxserve.api.streaming import ChoiceStream, collect, sse, stream_usage
from jaxserve.outputs import CompletionOutput, RequestOutput

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
    serving.check_truncation(req.truncate_prompt_tokens)
    result = []
    for item in items:
        if isinstance(item, str):
            ids = await serving.encode(item, req.add_special_tokens, req.truncate_prompt_tokens) if item else []
            # A truncated prompt's text is what its kept tokens decode to (for echo)
            result.append((item if req.truncate_prompt_tokens is None else None, ids))
        else:
            result.append((None, serving.truncate(list(item), req.truncate_prompt_tokens)))
    return result


async def _echo_logprobs(serving: ModelServing, output: RequestOutput, by_id: bool) -> CompletionLogprobs:
    """The prompt's part of `echo` with `logprobs`: each prompt token with its prompt logprob (None for
    the first) and the alternatives the request asked for, in the legacy completions shape (built on a worker
    thread: a long prompt's entries are many)."""
    entries = output.prompt_logprobs or [None] * output.num_prompt_tokens
    ids = {*output.prompt_token_ids, *(t for e in entries if e for t in e)}
    if by_id:  # named "token_id:{id}": nothing to decode
        strings = {t: serving.token_label(t, by_id=True) for t in ids}
    else:
        strings = await serving.token_strings(ids)

    def convert() -> CompletionLogprobs:
        result, text_offset = CompletionLogprobs(), 0
        for token_id, entry in zip(output.prompt_token_ids, entries, strict=True):
            token = strings[token_id]
            result.tokens.append(token)
            result.text_offset.append(text_offset)
            text_offset += len(token)
            result.token_logprobs.append(None if entry is None else entry[token_id].logprob)
            result.top_logprobs.append(None if entry is None else {strings[t]: lp.logprob for t, lp in entry.items()})
        return result

    return await asyncio.to_thread(convert)


def _joined(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        text_offset=first.text_offset + second.text_offset, token_logprobs=first.token_logprobs + second.token_logprobs,
        tokens=first.tokens + second.tokens, top_logprobs=first.top_logprobs + second.top_logprobs,
    )


def _end_offset(logprobs: CompletionLogprobs) -> int:
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1]) if logprobs.tokens else 0


def _logprobs(
    serving: ModelServing, completion: CompletionOutput, text_offset: int, by_id: bool
) -> CompletionLogprobs:
    """Logprobs of the completion's tokens (a stream's delta holds only the new ones), in the legacy
    completions shape. Each position's top_logprobs holds the sampled token first, then the alternatives
    asked for: up to logprobs + 1 entries, as OpenAI's legacy API and vLLM give them (logprobs=0: the
    sampled token's alone)."""
    result = CompletionLogprobs()
    top = completion.top_logprobs or []
    for i in range(len(completion.token_ids)):
        token = serving.token_label(completion.token_ids[i], by_id)
        result.tokens.append(token)
        result.token_logprobs.append(completion.token_logprobs[i])
        result.text_offset.append(text_offset)
        text_offset += len(token)
        alternatives = {serving.token_label(t, by_id): lp for t, lp in top[i].items()} if top else {}
        result.top_logprobs.append({token: completion.token_logprobs[i], **alternatives})
    return result


async def create_completion(request: Request) -> Response:
    serving = get_serving(request)
    req = await serving.parse(request, CompletionRequest)
    lora_name = serving.check_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (it must equal n when given)", "best_of")
    prompt_only = _prompt_only(req)
    prompts = await _prompts(serving, req)
    # Every prompt is checked before any starts, so a bad one is a 400 even when streaming. `echo` with
    # `logprobs` reports the prompt's tokens too: prompt logprobs with as many alternatives (vLLM's rule).
    echo_logprobs = req.logprobs if req.echo and req.prompt_logprobs is None else None
    max_tokens = 1 if prompt_only else req.max_tokens  # the engine generates at least one token
    params = [serving.sampling_params(req, ids, max_tokens, req.logprobs, echo_logprobs) for _, ids in prompts]
    beams = None
    if req.use_beam_search:
        if prompt_only:
            raise APIError(400, "beam search generates at least one token: max_tokens must be >= 1", "max_tokens")
        beams = [beam_search_params(serving, req, p, len(ids)) for (_, ids), p in zip(prompts, params, strict=True)]
    grammar = await serving.compile_grammar(params[0])  # every prompt has the same structured output
    if req.echo:
        prompts = [(text if text is not None else await serving.decode(ids), ids) for text, ids in prompts]
    request_id, engine_id = request_ids("cmpl", request, req.request_id)
    model_name = req.model or serving.model_names[0]
    if beams is not None:
        searches = [beam_search(serving, request, ids, b, f"{engine_id}-{i}", req.cache_salt, req.priority, lora_name)
                    for i, ((_, ids), b) in enumerate(zip(prompts, beams, strict=True))]
        return await _response(serving, req, request_id, model_name, prompts, await side_by_side(searches))
    streams = [serving.generate(ids, p, f"{engine_id}-{i}", req.cache_salt, grammar, req.priority, lora_name)
               for i, ((_, ids), p) in enumerate(zip(prompts, params, strict=True))]
    if prompt_only:
        streams = [_without_completions(stream) for stream in streams]
    choices = ChoiceStream(streams, req.n, [len(ids) for _, ids in prompts])
    if req.stream:
        include_usage, usage_every_chunk = stream_usage(req.stream_options, serving.config.enable_force_include_usage)

        def chunk(items: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
            if usage is None and usage_every_chunk and items:
                usage = choices.choice_usage(items[0].index)
            return CompletionResponse(id=request_id, model=model_name, choices=items, usage=usage)

        body = sse(_chunks(serving, req, prompts, choices, chunk),
                   (lambda: chunk([], choices.usage)) if include_usage else None)
        return StreamingResponse(body, media_type="text/event-stream")
    return await _response(serving, req, request_id, model_name, prompts, await collect(request, streams))


async def _response(serving: ModelServing, req: CompletionRequest, request_id: str, model_name: str,
                    prompts: list[tuple[str | None, list[int]]], finals: list[RequestOutput]) -> Response:
    """The whole answer from each prompt's final output."""
    by_id = serving.tokens_by_id(req)
    echoes = [await _echo_logprobs(serving, output, by_id) if req.echo and req.logprobs is not None else None
              for output in finals]
    prompt_logprobs = [await serving.prompt_logprobs(output) if req.prompt_logprobs is not None else None
                       for output in finals]
    if req.logprobs is not None:
        await serving.label_tokens(logprob_token_ids(c for output in finals for c in output.outputs), by_id)

    def build() -> CompletionResponse:
        items, num_generated = [], 0
        for prompt_index, output in enumerate(finals):
            prompt_text, prompt_ids = prompts[prompt_index]
            echoed = echoes[prompt_index]
            for completion in output.outputs:
                num_generated += len(completion.token_ids)
                logprobs = None
                if req.logprobs is not None:
                    logprobs = _logprobs(serving, completion, _end_offset(echoed) if echoed else 0, by_id)
                    logprobs = _joined(echoed, logprobs) if echoed else logprobs
                items.append(CompletionChoice(
                    index=prompt_index * req.n + completion.index,
                    text=((prompt_text or "") if req.echo else "") + completion.text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                    prompt_logprobs=prompt_logprobs[prompt_index],
                    token_ids=list(completion.token_ids) if req.return_token_ids else None,
                    prompt_token_ids=prompt_ids if req.return_token_ids else None,
                ))
        usage = UsageInfo.of(sum(len(ids) for _, ids in prompts), num_generated,
                             sum(o.num_cached_tokens for o in finals))
        return CompletionResponse(id=request_id, model=model_name, choices=items, usage=usage)

    echoed_prompts = req.logprobs if req.echo and req.logprobs is not None else req.prompt_logprobs
    return await serving.answer(build, sum(num_logprobs(output, req.logprobs, echoed_prompts) for output in finals))


async def _chunks(
    serving: ModelServing,
    req: CompletionRequest,
    prompts: list[tuple[str | None, list[int]]],
    choices: ChoiceStream,
    chunk: Callable[[list[CompletionChoice]], CompletionResponse],
) -> AsyncIterator[CompletionResponse]:
    started: set[int] = set()  # choices whose first chunk (the echoed prompt, its ids) is out
    by_id = serving.tokens_by_id(req)
    text_offsets = [0] * (len(prompts) * req.n)
    async for delta in choices:
        prompt_text, prompt_ids = prompts[delta.prompt_index]
        first = delta.index not in started
        started.add(delta.index)
        text, logprobs = delta.completion.text_delta, None
        if req.logprobs is not None:
            logprobs = _logprobs(serving, delta.completion, text_offsets[delta.index], by_id)
        if req.echo and first:  # as vLLM: the prompt leads the choice's first chunk
            text = (prompt_text or "") + text
            if logprobs is not None:
                prompt_part = await _echo_logprobs(serving, choices.prompt_outputs[delta.prompt_index], by_id)
                logprobs = _joined(prompt_part, _logprobs(serving, delta.completion, _end_offset(prompt_part), by_id))
        if logprobs is not None:
            text_offsets[delta.index] = _end_offset(logprobs) or text_offsets[delta.index]
        yield chunk([CompletionChoice(
            index=delta.index, text=text, logprobs=logprobs,
            finish_reason=delta.finish_reason, stop_reason=delta.completion.stop_reason,
            token_ids=list(delta.completion.token_ids) if req.return_token_ids else None,
            prompt_token_ids=prompt_ids if req.return_token_ids and first else None,
        )])


def _prompt_only(req: CompletionRequest) -> bool:
    """`echo` with `max_tokens` 0: the answer is the prompt alone, with its logprobs where asked (how the
    legacy completions API, and vLLM, score a text). Elsewhere `max_tokens` is at least 1."""
    if req.max_tokens != 0:
        return False
    if not req.echo:
        raise APIError(400, "max_tokens must be at least 1 (0 only with echo, which returns the prompt alone)",
                       "max_tokens")
    if req.min_tokens:
        raise APIError(400, "min_tokens must be 0 when max_tokens is 0", "min_tokens")
    return True


async def _without_completions(outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """A prompt-only request's outputs: the one token its engine request generates is dropped (no text, id or
    logprob of it anywhere, usage included), and each choice finishes by length, as after 0 tokens."""
    async for output in outputs:
        yield dataclasses.replace(output, outputs=[
            CompletionOutput(index=c.index, token_logprobs=[] if c.token_logprobs is not None else None,
                             top_logprobs=[] if c.top_logprobs is not None else None,
                             finish_reason="length" if c.finished else None)
            for c in output.outputs])
