"""Beam search (vLLM's `use_beam_search`), run by the API on top of the engine, one token at a time.

Each round asks the engine for one token after every live beam, with that token's 2 x width most likely
alternatives and their logprobs; each beam is extended by each alternative, and the `width` extensions
with the highest cumulative logprob live on. An extension by an EOS token finishes its beam instead
(unless `ignore_eos`). After `max_tokens` rounds, or once no beam is live, finished and live beams are
ranked by cumulative logprob / length ** length_penalty, the length counting the prompt and not a final
EOS (vLLM's score), and the best `width` become the `n` choices, best first. A round's beams share the
prompt and most of their tokens, so the prefix cache serves most of each round's prefill.

`search` takes the model as a callback, so it runs against any next-token distribution (the tests' oracle
among them); `beam_search` runs it on the engine for one request.
"""

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import Request

from jaxserve.api.errors import APIError
from jaxserve.api.protocol import SamplingFields
from jaxserve.api.serving import ModelServing
from jaxserve.api.streaming import collect
from jaxserve.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from jaxserve.sampling_params import SamplingParams

T = TypeVar("T")
_MAX_EXPONENT = 700.0  # e ** 700 is near the largest float (e ** 709.8)

# The generated tokens of each live beam -> for each, its next token's alternatives: token id -> logprob
NextLogprobs = Callable[[list[tuple[int, ...]]], Awaitable[list[dict[int, float]]]]


@dataclass(frozen=True)
class Beam:
    token_ids: tuple[int, ...]  # generated; an EOS last where it finished the beam
    cumulative_logprob: float
    finished: bool = False


@dataclass(frozen=True)
class BeamSearchParams:
    width: int  # the request's n
    max_tokens: int
    length_penalty: float
    ignore_eos: bool
    skip_special_tokens: bool
    include_stop_str_in_output: bool  # a finished beam's EOS in its token ids (never in its text)


def score(beam: Beam, num_prompt_tokens: int, length_penalty: float) -> float:
    """vLLM's ranking of beams: cumulative logprob / length ** length_penalty, the length counting the prompt
    and not a final EOS."""
    length = num_prompt_tokens + len(beam.token_ids) - beam.finished
    return beam.cumulative_logprob / length**length_penalty


async def search(next_logprobs: NextLogprobs, num_prompt_tokens: int, width: int, max_tokens: int,
                 eos_token_ids: frozenset[int], length_penalty: float) -> list[Beam]:
    """The best `width` beams, best first (ties in the order they were found)."""
    live, finished = [Beam((), 0.0)], []
    for _ in range(max_tokens):
        if not live:
            break
        extended = []
        alternatives = await next_logprobs([beam.token_ids for beam in live])
        for beam, candidates in zip(live, alternatives, strict=True):
            for token_id, logprob in candidates.items():
                ends = token_id in eos_token_ids
                (finished if ends else extended).append(
                    Beam((*beam.token_ids, token_id), beam.cumulative_logprob + logprob, ends))
        # One length among them, so this is their cumulative logprob's order too
        live = sorted(extended, key=lambda b: score(b, num_prompt_tokens, length_penalty), reverse=True)[:width]
    return sorted(finished + live, key=lambda b: score(b, num_prompt_tokens, length_penalty), reverse=True)[:width]


def beam_search_params(serving: ModelServing, req: SamplingFields, checked: SamplingParams,
                       num_prompt_tokens: int) -> BeamSearchParams:
    """The search's parameters from a request whose fields `serving.sampling_params` checked already
    (`checked`); a 400 naming the field for what beam search cannot answer. Sampling fields (temperature,
    top_p, penalties, stop strings) do not apply: beams are ranked by the model's own logprobs, as vLLM's are."""
    max_width = serving.info.limits.max_logprobs // 2
    if req.n > max_width:
        raise APIError(400, f"n is the beam width, which is at most {max_width} on this server (each round reads "
                            f"2 x n alternatives, --max-logprobs {serving.info.limits.max_logprobs})", "n")
    if req.stream:
        raise APIError(400, "beam search answers with its finished beams: stream must be false", "stream")
    if req.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs are not available with use_beam_search", "prompt_logprobs")
    if checked.logprobs is not None:
        raise APIError(400, "logprobs are not available with use_beam_search", "logprobs")
    if checked.structured_outputs is not None:
        raise APIError(400, "structured outputs are not available with use_beam_search", "use_beam_search")
    # A score divides by length ** length_penalty, a length up to the context's: it must stay a float
    bound = _MAX_EXPONENT / math.log(max(serving.max_model_len, 2))
    if not abs(req.length_penalty) <= bound:  # NaN too
        raise APIError(400, f"length_penalty must be a number in [-{bound:.0f}, {bound:.0f}] on this server",
                       "length_penalty")
    max_tokens = checked.max_tokens
    if max_tokens is None:  # up to the context length
        max_tokens = serving.max_model_len - num_prompt_tokens
    return BeamSearchParams(req.n, max_tokens, req.length_penalty, checked.ignore_eos, checked.skip_special_tokens,
                            checked.include_stop_str_in_output)


async def beam_search(serving: ModelServing, request: Request, prompt_ids: list[int], params: BeamSearchParams,
                      request_id: str, cache_salt: str | None = None, priority: int = 0,
                      lora_name: str | None = None) -> RequestOutput:
    """The search on the engine for one prompt: its beams as the `n` completions of one final output (what
    the engine's own requests end in), finish_reason "stop" for a beam that ended in EOS, else "length".
    Cancelled with its engine requests if the client leaves."""
    step = SamplingParams(n=1, temperature=0.0, max_tokens=1, logprobs=2 * params.width, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA)
    eos = frozenset(() if params.ignore_eos else serving.info.eos_token_ids)
    rounds = 0
    num_cached = 0

    async def next_logprobs(beams: list[tuple[int, ...]]) -> list[dict[int, float]]:
        nonlocal rounds, num_cached
        streams = [serving.generate([*prompt_ids, *beam], step, f"{request_id}-{rounds}-{i}", cache_salt,
                                    priority=priority, lora_name=lora_name) for i, beam in enumerate(beams)]
        finals = await collect(request, streams)
        if rounds == 0:
            num_cached = finals[0].num_cached_tokens
        rounds += 1
        return [final.outputs[0].top_logprobs[0] for final in finals]

    beams = await search(next_logprobs, len(prompt_ids), params.width, params.max_tokens, eos,
                         params.length_penalty)
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
