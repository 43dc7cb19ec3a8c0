"""The sort-free vocabulary selections against numpy oracles (float64 where sums are involved)."""

import jax
import numpy as np
import pytest

from jaxserve.runner.selection import CHUNK, first_argmax, sample_categorical, top_k, top_k_threshold, top_p_threshold

VOCABS = [CHUNK * 5, 50257, 77]  # a multiple of the chunk, GPT-2's odd vocabulary, less than one chunk


def rows_with_hazards(vocab: int, seed: int) -> np.ndarray:
    """Random logits plus rows with ties across chunks, -inf stretches and a lone finite token."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((8, vocab)) * 3).astype(np.float32)
    x[1, [3, vocab // 2, vocab - 1]] = 50.0  # a three-way tie for the maximum: the first index wins
    x[2, : vocab - 1] = -np.inf  # only the last token is finite
    x[3, ::2] = -np.inf
    x[4] = np.round(x[4])  # many ties everywhere
    x[5, vocab - 1] = 99.0  # the maximum in the padded last chunk
    return x


@pytest.mark.parametrize("vocab", VOCABS)
def test_first_argmax_is_numpys_argmax(vocab):
    x = rows_with_hazards(vocab, 0)
    np.testing.assert_array_equal(np.asarray(jax.jit(first_argmax)(x)), x.argmax(-1))


@pytest.mark.parametrize("vocab", VOCABS)
def test_top_k_threshold_is_the_kth_largest_probability(vocab):
    x = rows_with_hazards(vocab, 1)
    probs = np.exp(x - x.max(-1, keepdims=True)).astype(np.float32)
    ks = np.array([1, 2, 5, 40, vocab, vocab + 7, 0, 3], np.int32)
    got = np.asarray(jax.jit(top_k_threshold)(probs, ks))
    for row, k in enumerate(ks):
        expected = 0.0 if k == 0 else np.sort(probs[row])[::-1][min(k, vocab) - 1]
        assert got[row] == expected, (row, k)


@pytest.mark.gpu  # in `make test-gpu`: XLA:GPU's TopK kernel (the pieces) and its sort (k whole) on the device
@pytest.mark.parametrize("on_cuda", [False, True], ids=["whole", "in pieces of 16"])
@pytest.mark.parametrize("k", [5, 16, 20, 40])
def test_top_k_is_a_stable_descending_sort_s_first_k(k, on_cuda):
    """Largest first, the lower index first among equals, also where a tie straddles two pieces."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 50257)).astype(np.float32)
    x[1] = np.round(x[1] * 2)  # many ties everywhere
    x[2, 100:130] = 9.0  # 30 equal maxima: the 16th and 17th are equal
    x[3, [7, 70000 % 50257, 50256]] = 8.0
    values, indices = jax.jit(top_k, static_argnums=(1, 2))(x, k, on_cuda)
    order = np.argsort(-x, axis=-1, kind="stable")[:, :k]
    np.testing.assert_array_equal(np.asarray(indices), order)
    np.testing.assert_array_equal(np.asarray(values), np.take_along_axis(x, order, axis=-1))


def top_p_oracle(probs: np.ndarray, top_p: float, floor: float) -> set[int]:
    """The sorted rule in float64: keep tokens in descending order while the mass before them is under
    top_p of the eligible total; a tie group shares the first member's mass before."""
    p = np.where(probs >= floor, probs, 0.0).astype(np.float64)
    ascending = np.sort(p)
    at_or_below = np.cumsum(ascending)[np.searchsorted(ascending, p, side="right") - 1]  # [V]
    above = ascending.sum() - at_or_below  # mass strictly above each token
    return set(np.flatnonzero((p > 0) & (above < top_p * ascending.sum())).tolist())


@pytest.mark.parametrize("vocab", VOCABS)
def test_top_p_threshold_keeps_the_sorted_rules_set(vocab):
    rng = np.random.default_rng(2)
    for trial in range(6):
        x = rows_with_hazards(vocab, 10 + trial)
        probs = np.exp(x - x.max(-1, keepdims=True)).astype(np.float32)
        top_p = rng.uniform(0.05, 1.0, len(x)).astype(np.float32)
        top_p[0] = 1.0
        floor = np.where(rng.random(len(x)) < 0.5, np.sort(probs, -1)[:, -min(vocab, 20)], 0.0).astype(np.float32)
        got = np.asarray(jax.jit(top_p_threshold)(probs, top_p, floor))
        for row in range(len(x)):
            kept = set(np.flatnonzero(probs[row] >= got[row]).tolist())
            if top_p[row] == 1.0:
                assert got[row] == 0.0
                continue
            expected = top_p_oracle(probs[row], float(top_p[row]), float(floor[row]))
            eligible = np.where(probs[row] >= floor[row], probs[row], 0).astype(np.float64)
            for token in kept ^ expected:  # only float32-vs-float64 rounding at the boundary may differ
                above = eligible[eligible > probs[row, token]].sum() / eligible.sum()
                assert abs(above - top_p[row]) < 1e-5, (trial, row, token, above, top_p[row])
            assert kept and len(kept ^ expected) <= 1


@pytest.mark.parametrize("vocab", VOCABS)
def test_categorical_draw_is_the_inverse_cdf(vocab):
    rng = np.random.default_rng(3)
    weights = rng.random((4, vocab)).astype(np.float32) ** 4
    weights[1, rng.random(vocab) < 0.9] = 0.0  # mostly zero
    weights[2, :] = 0.0
    weights[2, [0, vocab - 1]] = 1.0  # two tokens at both ends
    weights[3, :-1] = 0.0  # only the last token (in the padded chunk when V is not a multiple)
    weights[3, -1] = 1e-30
    num_draws = 512
    uniforms = np.concatenate([(np.arange(num_draws - 2) + 0.5) / (num_draws - 2), [0.0, 1 - 2**-24]])
    draw = jax.jit(jax.vmap(sample_categorical, in_axes=(None, 0)))
    got = np.asarray(draw(weights, np.tile(uniforms[:, None], (1, 4)).astype(np.float32)))  # [draws, rows]
    for row in range(4):
        cdf = np.cumsum(weights[row].astype(np.float64))
        expected = np.searchsorted(cdf / cdf[-1], uniforms, side="right")
        expected = np.minimum(expected, np.flatnonzero(weights[row])[-1])
        assert (weights[row, got[:, row]] > 0).all(), "a zero-weight token was drawn"
        mismatched = np.flatnonzero(got[:, row] != expected)
        # Only where u sits on a CDF step (float32 sums differ from float64 there).
        for i in mismatched:
            step = cdf[min(got[i, row], expected[i])] / cdf[-1]
            assert abs(step - uniforms[i]) < 1e-5, (row, i, got[i, row], expected[i])
        assert len(mismatched) <= 2


def test_no_zero_weight_draw_where_blocked_prefix_sums_round():
    """XLA:CPU's cumsum adds in blocks: over many all-zero chunks its prefix sums can step up or down by
    rounding. Uniforms placed right at those steps must still draw tokens with weight."""
    vocab = 128256  # Llama 3's vocabulary: 1,002 chunks
    rng = np.random.default_rng(0)
    weights = (rng.random((1, vocab)) ** 6).astype(np.float32)
    weights[:, np.repeat(rng.random(vocab // CHUNK) < 0.5, CHUNK)] = 0.0  # half the chunks filtered out
    chunk_mass = weights.reshape(-1, CHUNK).sum(-1)
    boundaries = (np.cumsum(chunk_mass.astype(np.float64)) / chunk_mass.sum())[:-1].astype(np.float32)
    below, above = boundaries.copy(), boundaries.copy()
    uniforms = [boundaries]
    for _ in range(3):  # three float32 steps either side of every chunk boundary
        below, above = np.nextafter(below, np.float32(0)), np.nextafter(above, np.float32(1))
        uniforms += [below, above]
    uniforms = np.clip(np.concatenate(uniforms), 0.0, 1 - 2**-24).astype(np.float32)
    draw = jax.jit(jax.vmap(sample_categorical, in_axes=(None, 0)))
    tokens = np.asarray(draw(weights, uniforms[:, None]))[:, 0]
    assert (weights[0, tokens] > 0).all(), f"zero-weight tokens drawn: {tokens[weights[0, tokens] == 0][:5]}"
