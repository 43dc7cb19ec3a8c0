"""Text pairs scored by the cosine similarity of their embeddings, as vLLM scores them with a bi-encoder:
one rule for the server's /score and /rerank and for `LLM.score`. Pure numpy, no jax."""

import numpy as np


def finish_embedding(vector: list[float], dimensions: int | None, normalize: bool) -> np.ndarray:
    """The pooled vector cut to its first `dimensions` values, then scaled to unit length: f32[k]."""
    result = np.asarray(vector, np.float32)[:dimensions]
    if normalize:
        result = result / max(float(np.linalg.norm(result)), 1e-12)
    return result


def check_pairing(num_firsts: int, num_seconds: int) -> None:
    """vLLM's pairings of two lists of texts: one to one, or one first against every second."""
    if num_firsts == 0 or num_seconds == 0:
        raise ValueError("texts to score must not be empty lists")
    if num_firsts > 1 and num_firsts != num_seconds:
        raise ValueError(f"the first and second texts must pair 1:1, 1:N or N:N; got {num_firsts}:{num_seconds}")


def cosine_scores(firsts: list[list[float]], seconds: list[list[float]]) -> list[float]:
    """cos(first_i, second_i) for each pair, one first broadcast against every second."""
    check_pairing(len(firsts), len(seconds))
    first = np.stack([finish_embedding(v, None, normalize=True) for v in firsts])  # f32[1 or n, d], unit rows
    second = np.stack([finish_embedding(v, None, normalize=True) for v in seconds])  # f32[n, d]
    return (first * second).sum(axis=1).tolist()


def class_probabilities(logits: list[float], activation: str = "softmax") -> np.ndarray:
    """A classifier's outputs from its logits, f64[L], by its `activation` (`classifier.class_activation`): a
    softmax, a sigmoid per class, or none (the logits). Values JSON cannot carry (a model's overflow to
    infinities, NaN) are first brought into float32's range (NaN as 0)."""
    big = float(np.finfo(np.float32).max)
    values = np.nan_to_num(np.asarray(logits, np.float64), nan=0.0, posinf=big, neginf=-big)
    if activation == "none":
        return values
    if activation == "sigmoid":
        return 0.5 * (1.0 + np.tanh(0.5 * values))  # without overflow at large |x|
    exps = np.exp(values - values.max())
    return exps / exps.sum()
