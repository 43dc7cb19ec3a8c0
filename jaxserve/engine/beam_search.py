"""Beam search (vLLM's), as a state that its caller moves a round at a time: pure Python, no engine, no I/O.

Each round needs, for every live beam, its next token's 2 x width most likely alternatives and their
logprobs; each beam is extended by each alternative, and the `width` extensions with the highest
cumulative logprob live on. An extension by an EOS token finishes its beam instead. After `max_tokens`
rounds, or once no beam is live, finished and live beams are ranked by cumulative logprob /
length ** length_penalty, the length counting the prompt and not a final EOS (vLLM's score), and the best
`width` are the result, best first.

The server moves one search with awaits (api/beam_search.py); `LLM.beam_search` moves many at once, a round
of every prompt in one engine batch.
"""

import math
from dataclasses import dataclass

from jaxserve.sampling_params import InvalidParam

Alternatives = dict[int, float]  # a beam's next token's alternatives: token id -> logprob under the model


@dataclass(frozen=True)
class Beam:
    token_ids: tuple[int, ...]  # generated; an EOS last where it finished the beam
    cumulative_logprob: float
    finished: bool = False
    alternatives: tuple[Alternatives, ...] = ()  # per generated token, the alternatives it was chosen among


def score(beam: Beam, num_prompt_tokens: int, length_penalty: float) -> float:
    """vLLM's ranking of beams: cumulative logprob / length ** length_penalty, the length counting the prompt
    and not a final EOS."""
    length = num_prompt_tokens + len(beam.token_ids) - beam.finished
    return beam.cumulative_logprob / length**length_penalty


def check_search(beam_width: int, length_penalty: float, max_logprobs: int, max_model_len: int) -> None:
    """What an engine can search, InvalidParam naming the field otherwise: each round reads 2 x beam_width
    alternatives, at most max_logprobs; a score divides by length ** length_penalty, a length up to the
    context's, and must stay a float (e ** 700 is near the largest, e ** 709.8)."""
    if beam_width > (max_width := max_logprobs // 2):
        raise InvalidParam(f"beam_width is at most {max_width} on this engine (each round reads 2 x beam_width "
                           f"alternatives, max_logprobs {max_logprobs})", "beam_width")
    bound = 700.0 / math.log(max(max_model_len, 2))
    if not abs(length_penalty) <= bound:  # NaN too
        raise InvalidParam(f"length_penalty must be in [-{bound:.0f}, {bound:.0f}] on this engine", "length_penalty")


class BeamSearch:
    """One prompt's search: `live_token_ids()` are what the next round asks the model about, `extend` takes its
    answer, and once `done`, `best()` are the best `width` beams, best first (ties in the order found)."""

    def __init__(self, num_prompt_tokens: int, width: int, max_tokens: int, eos_token_ids: frozenset[int],
                 length_penalty: float) -> None:
        self.num_prompt_tokens, self.width, self.length_penalty = num_prompt_tokens, width, length_penalty
        self.eos_token_ids = eos_token_ids
        self.rounds_left = max_tokens
        self.live, self.finished = [Beam((), 0.0)], []

    @property
    def done(self) -> bool:
        return not self.live or self.rounds_left <= 0

    def live_token_ids(self) -> list[tuple[int, ...]]:
        return [beam.token_ids for beam in self.live]

    def extend(self, alternatives: list[Alternatives]) -> None:
        """A round: each live beam's next token's alternatives, in the order of `live_token_ids()`."""
        extended = []
        for beam, candidates in zip(self.live, alternatives, strict=True):
            for token_id, logprob in candidates.items():
                ends = token_id in self.eos_token_ids
                (self.finished if ends else extended).append(Beam(
                    (*beam.token_ids, token_id), beam.cumulative_logprob + logprob, ends,
                    (*beam.alternatives, candidates)))
        self.live = self._ranked(extended)  # one length among them, so this is their cumulative logprob's order
        self.rounds_left -= 1

    def best(self) -> list[Beam]:
        return self._ranked(self.finished + self.live)

    def _ranked(self, beams: list[Beam]) -> list[Beam]:
        return sorted(beams, key=lambda b: score(b, self.num_prompt_tokens, self.length_penalty),
                      reverse=True)[:self.width]
