"""Encoder attention (`ops/encoder_attention.py`) against a float64 oracle: prompts packed back to back with
padding after them, each token attending over its own prompt both ways; and BERT's token types read from the
separator (`models/bert.token_types`)."""

import itertools

import jax.numpy as jnp
import numpy as np

from jaxserve.models.bert import token_types
from jaxserve.ops.encoder_attention import encoder_attention, token_rows


def _oracle(q: np.ndarray, k: np.ndarray, v: np.ndarray, cu_q_lens: list[int]) -> np.ndarray:
    out = np.zeros_like(q)
    for start, end in itertools.pairwise(cu_q_lens):
        if start == end:
            continue
        scores = np.einsum("tnh,snh->nts", q[start:end], k[start:end]) / np.sqrt(q.shape[-1])
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[start:end] = np.einsum("nts,snh->tnh", probs, v[start:end])
    return out


def test_each_token_attends_over_its_own_prompt_both_ways():
    rng = np.random.default_rng(0)
    cu_q_lens = [0, 5, 6, 13, 13]  # prompts of 5, 1 and 7 tokens, an empty row, then 3 tokens of padding
    q, k, v = (rng.normal(size=(16, 4, 8)) for _ in range(3))
    rows = token_rows(jnp.asarray(cu_q_lens, jnp.int32), 16)
    assert rows.tolist() == [0] * 5 + [1] + [2] * 7 + [4] * 3
    got = encoder_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), rows)
    np.testing.assert_allclose(np.asarray(got)[:13], _oracle(q, k, v, cu_q_lens)[:13], rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(got)).all()  # padding attends among itself: finite


def test_queries_in_blocks_are_the_whole_step_s():
    """A long step takes its queries a block at a time; prompts that cross a block's edge attend as in one."""
    rng = np.random.default_rng(1)
    cu_q_lens = [0, 3, 11, 20, 29]  # prompts over the blocks' edges at 8, 16 and 24; then 3 tokens of padding
    q, k, v = (rng.normal(size=(32, 2, 4)) for _ in range(3))
    rows = token_rows(jnp.asarray(cu_q_lens, jnp.int32), 32)
    inputs = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    blocked = np.asarray(encoder_attention(*inputs, rows, query_block=8))
    np.testing.assert_allclose(blocked[:29], _oracle(q, k, v, cu_q_lens)[:29], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(blocked, np.asarray(encoder_attention(*inputs, rows)), rtol=1e-6, atol=1e-6)


def test_token_types_turn_to_one_past_each_prompt_s_first_separator():
    sep = 3
    prompts = [[2, 7, 8, 3, 9, 9, 3], [2, 5, 3], [2, 7, 3, 8, 3, 8, 3]]  # a pair, a text, a pair with a [SEP] inside
    ids = [token for prompt in prompts for token in prompt] + [0, 0]
    cu_q_lens = jnp.asarray([0, 7, 10, 17], jnp.int32)
    types = token_types(jnp.asarray(ids, jnp.int32), cu_q_lens, token_rows(cu_q_lens, len(ids)), sep)
    assert types.tolist()[:17] == [*(0, 0, 0, 0, 1, 1, 1), *(0, 0, 0), *(0, 0, 0, 1, 1, 1, 1)]
