"""Beam search (vLLM's `use_beam_search`) for the API: the engine's search (engine/beam_search.py) moved a
round at a time, each round one engine request per live beam for one token and its 2 x width most likely
alternatives. A round's beams share the prompt and most of their tokens, so the prefix cache serves most of
each round's prefill.
"""

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import Request

from jaxserve.api.errors import APIError
from jaxserve.api.protocol import SamplingFields
from jaxserve.api.serving import ModelServing
from jaxserve.api.streaming import collect
from jaxserve.engine.beam_search import BeamSearch, check_search
from jaxserve.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from jaxserve.sampling_params import BeamSearchParams, InvalidParam, SamplingParams

T = TypeVar("T")


@dataclass(frozen=True)
class ServedBeamSearch(BeamSearchParams):
    """A request's beam search: vLLM's parameters, and whether the beams' text skips special tokens."""

    skip_special_tokens: bool = True


def beam_search_params(serving: ModelServing, req: SamplingFields, checked: SamplingParams,
                       num_prompt_tokens: int) -> ServedBeamSearch:
    """The search's parameters from a request whose fields `serving.sampling_params` checked already
    (`checked`); a 400 naming the field for what beam search cannot answer. Sampling fields (temperature,
    top_p, penalties, stop strings) do not apply: beams are ranked by the model's own logprobs, as vLLM's are."""
    try:
        check_search(req.n, req.length_penalty, serving.info.limits.max_logprobs, serving.max_model_len)
    except InvalidParam as error:  # the request's n is the beam width
        raise APIError(400, f"n is the beam width: {error}" if error.param == "beam_width" else str(error),
                       "n" if error.param == "beam_width" else error.param) from None
    if req.stream:
        raise APIError(400, "beam search answers with its finished beams: stream must be false", "stream")
    if req.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs are not available with use_beam_search", "prompt_logprobs")
    if checked.logprobs is not None:
        raise APIError(400, "logprobs are not available with use_beam_search", "logprobs")
    if checked.structured_outputs is not None:
        raise APIError(400, "structured outputs are not available with use_beam_search", "use_beam_search")
    if checked.allowed_token_ids is not None:  # beams rank the model's own logprobs, which no mask changes
        raise APIError(400, "allowed_token_ids are not available with use_beam_search", "allowed_token_ids")
    max_tokens = checked.max_tokens
    if max_tokens is None:  # up to the context length
        max_tokens = serving.max_model_len - num_prompt_tokens
    try:
        return ServedBeamSearch(req.n, max_tokens, checked.ignore_eos, length_penalty=req.length_penalty,
                                include_stop_str_in_output=checked.include_stop_str_in_output,
                                skip_special_tokens=checked.skip_special_tokens)
    except InvalidParam as error:  # beam search generates at least one token
        raise APIError(400, str(error), error.param) from None


async def beam_search(serving: ModelServing, request: Request, prompt_ids: list[int], params: ServedBeamSearch,
                      request_id: str, cache_salt: str | None = None, priority: int = 0,
                      lora_name: str | None = None) -> RequestOutput:
    """The search on the engine for one prompt: its beams as the `n` completions of one final output (what
    the engine's own requests end in), finish_reason "stop" for a beam that ended in EOS, else "length".
    Cancelled with its engine requests if the client leaves."""
    step = SamplingParams(n=1, temperature=0.0, max_tokens=1, logprobs=2 * params.beam_width, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA)
    eos = frozenset(() if params.ignore_eos else serving.info.eos_token_ids)
    search = BeamSearch(len(prompt_ids), params.beam_width, params.max_tokens, eos, params.length_penalty)
    rounds = 0
    num_cached = 0
    while not search.done:
        streams = [serving.generate([*prompt_ids, *beam], step, f"{request_id}-{rounds}-{i}", cache_salt,
                                    priority=priority, lora_name=lora_name)
                   for i, beam in enumerate(search.live_token_ids())]
        finals = await collect(request, streams)
        if rounds == 0:
            num_cached = finals[0].num_cached_tokens
        rounds += 1
        search.extend([final.outputs[0].top_logprobs[0] for final in finals])
    beams = search.best()
    without_eos = [list(b.token_ids[:-1] if b.finished else b.token_ids) for b in beams]
    texts = await asyncio.gather(*(serving.decode(ids, skip_special_tokens=params.skip_special_tokens)
                                   for ids in without_eos))
    # vLLM's: a finished beam's EOS stays out of its token ids (and usage) unless include_stop_str_in_output
    outputs = [CompletionOutput(index=i, text=text,
                                token_ids=list(beam.token_ids) if params.include_stop_str_in_output else ids,
                                finish_reason="stop" if beam.finished else "length",
                                stop_reason=beam.token_ids[-1] if beam.finished else None,
                                cumulative_logprob=beam.cumulative_logprob)
               for i, (beam, ids, text) in enumerate(zip(beams, without_eos, texts, strict=True))]
    return RequestOutput(request_id, None, prompt_ids, outputs, finished=True, num_cached_tokens=num_cached)


async def side_by_side(searches: list[Awaitable[T]]) -> list[T]:
    """Runs several prompts' searches at once; the first to fail (or a client that left) cancels the rest,
    and its error is raised as it is (an APIError keeps its status)."""
    tasks = [asyncio.ensure_future(search) for search in searches]
    try:
        return await asyncio.gather(*tasks)
    finally:  # the others stopped (their engine requests aborted) before the answer goes out
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
