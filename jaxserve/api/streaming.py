"""The one streaming core of /v1/completions and /v1/chat/completions.

An HTTP request starts one engine request per prompt, each with n completions, whose outputs are
deltas (`RequestOutputKind.DELTA`: the engine copies nothing it sent before). `ChoiceStream` merges them
into per-choice deltas (text, new tokens, finish), counting usage as it goes; `sse` frames chunks as
server-sent events and ends every stream the same way: the usage chunk if asked, an error event if the
engine failed, then `[DONE]`. `collect` is the non-streamed path: it adds each request's deltas up.
Everything here runs on the event loop.
"""

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pydantic import BaseModel
from starlette.requests import Request

from jaxserve.api.errors import APIError, error_body
from jaxserve.api.protocol import StreamOptions, UsageInfo
from jaxserve.api.serving import merge_streams, unless_disconnected
from jaxserve.engine.async_engine import EngineDeadError, RequestFailedError
from jaxserve.outputs import CompletionOutput, RequestOutput, add_delta
from jaxserve.sampling_params import InvalidParam

ENGINE_ERRORS = (ValueError, EngineDeadError, RequestFailedError)

logger = logging.getLogger(__name__)


def engine_error(e: BaseException) -> APIError:
    """Maps what a running request can raise to the status a client should see."""
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine is not running: {e}")
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e))
    return APIError(400, str(e), e.param if isinstance(e, InvalidParam) else None)


@dataclass(frozen=True)
class ChoiceDelta:
    """What one choice gained since it was last sent."""

    index: int  # the choice's index in the response: prompt_index * n + completion index
    prompt_index: int
    completion: CompletionOutput  # a delta: its text, token ids and logprobs are the new ones

    @property
    def finish_reason(self) -> str | None:
        return self.completion.finish_reason


class ChoiceStream:
    """Per-choice deltas over several engine requests, with usage counted as they stream."""

    def __init__(self, streams: list[AsyncIterator[RequestOutput]], n: int, prompt_lengths: list[int]) -> None:
        self._streams = streams
        self._n = n
        self._finished: set[int] = set()
        self._cached_tokens = [0] * len(streams)  # per prompt, from its latest output
        self._prompt_lengths = prompt_lengths  # per prompt (one per stream)
        self._choice_tokens = [0] * (len(streams) * n)  # generated so far, per choice
        self.num_prompt_tokens = sum(prompt_lengths)
        # Per prompt, the output that brought its prompt facts (prompt logprobs come once), else its first.
        self.prompt_outputs: list[RequestOutput | None] = [None] * len(streams)

    @property
    def usage(self) -> UsageInfo:
        return UsageInfo.of(self.num_prompt_tokens, sum(self._choice_tokens), sum(self._cached_tokens))

    def choice_usage(self, index: int) -> UsageInfo:
        """Choice `index`'s usage so far: its prompt's tokens and its own generated ones (what vLLM's
        `continuous_usage_stats` puts in each of a choice's chunks)."""
        prompt_index = index // self._n
        return UsageInfo.of(self._prompt_lengths[prompt_index], self._choice_tokens[index],
                            self._cached_tokens[prompt_index])

    async def __aiter__(self) -> AsyncIterator[ChoiceDelta]:
        async for prompt_index, output in merge_streams(self._streams):
            self._cached_tokens[prompt_index] = output.num_cached_tokens
            if self.prompt_outputs[prompt_index] is None or output.prompt_logprobs is not None:
                self.prompt_outputs[prompt_index] = output  # the prompt's facts for echo: sent once, kept
            for completion in output.outputs:
                index = prompt_index * self._n + completion.index
                if index in self._finished or not (completion.text or completion.finished or completion.token_ids):
                    continue
                self._choice_tokens[index] += len(completion.token_ids)
                if completion.finished:
                    self._finished.add(index)
                yield ChoiceDelta(index, prompt_index, completion)


def stream_usage(options: StreamOptions | None, force: bool = False) -> tuple[bool, bool]:
    """(a usage chunk after the last, the usage so far in every chunk): `include_usage`, or `force`
    (--enable-force-include-usage) whatever the request says, and vLLM's `continuous_usage_stats`, which
    counts only beside them."""
    at_end = bool(options and options.include_usage) or force
    return at_end, at_end and options is not None and options.continuous_usage_stats


def sse_data(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


async def sse(chunks: AsyncIterator[BaseModel], usage_chunk: Callable[[], BaseModel] | None) -> AsyncIterator[str]:
    """Server-sent events: each chunk, then the usage chunk (if asked), then `[DONE]`. An engine error
    after the 200 was sent becomes an error event before `[DONE]` (vLLM does the same)."""
    try:
        async for chunk in chunks:
            yield sse_data(chunk)
        if usage_chunk is not None:
            yield sse_data(usage_chunk())
    except ENGINE_ERRORS as e:
        error = engine_error(e)
        yield sse_data(error_body(error.status, error.message, error.param))
    except Exception:  # a fault of the server's own after the 200: an error event, not a body cut mid-chunk
        logger.exception("a stream failed after its response began")
        yield sse_data(error_body(500, "internal server error"))
    yield "data: [DONE]\n\n"


async def finals(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Each engine request's final output, in prompt order; cancelling this aborts the requests."""
    result: list[RequestOutput | None] = [None] * len(streams)
    async for index, delta in merge_streams(streams):
        result[index] = add_delta(result[index], delta)
    return result


async def collect(request: Request, streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Each engine request's final output, in prompt order; cancelled if the client leaves."""
    try:
        return await unless_disconnected(request, finals(streams))
    except ENGINE_ERRORS as e:
        raise engine_error(e) from None
