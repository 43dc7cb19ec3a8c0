"""Beam search's references: a toy next-token model that depends on the whole prefix, the search driven on a
model by the engine's `BeamSearch`, and vLLM's algorithm written out on arrays (float64)."""

import numpy as np

from jaxserve.engine.beam_search import Beam, BeamSearch


def toy_model(vocab: int, seed: int):
    """A next-token distribution that depends on the whole prefix: float64 logprobs."""

    def logprobs(prefix: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng([seed, len(prefix), *prefix])
        logits = rng.normal(scale=2.0, size=vocab)
        return logits - np.logaddexp.reduce(logits)

    return logprobs


def top(logprobs: np.ndarray, k: int) -> dict[int, float]:
    """The k most likely tokens, most likely first (ties by id)."""
    return {int(t): float(logprobs[t]) for t in np.argsort(-logprobs, kind="stable")[:k]}


def run_search(model, num_prompt: int, width: int, max_tokens: int, eos: frozenset[int],
               length_penalty: float) -> list[Beam]:
    search = BeamSearch(num_prompt, width, max_tokens, eos, length_penalty)
    while not search.done:
        search.extend([top(model(beam), 2 * width) for beam in search.live_token_ids()])
    return search.best()


def oracle(model, num_prompt: int, width: int, max_tokens: int, eos: set[int], length_penalty: float):
    """vLLM's beam search written out on arrays: (tokens, cumulative logprob, ended by EOS), best first."""
    def score(tokens, total, ended):
        return total / (num_prompt + len(tokens) - ended) ** length_penalty

    live, done = [((), 0.0)], []
    for _ in range(max_tokens):
        if not live:
            break
        grown = []
        for tokens, total in live:
            lp = model(tokens)
            for t in np.argsort(-lp, kind="stable")[:2 * width]:
                entry = ((*tokens, int(t)), total + lp[t])
                (done if int(t) in eos else grown).append((*entry, int(t) in eos))
        grown.sort(key=lambda e: -e[1])
        live = [(tokens, total) for tokens, total, _ in grown[:width]]
    finished = done + [(tokens, total, False) for tokens, total in live]
    return sorted(finished, key=lambda e: -score(*e))[:width]
