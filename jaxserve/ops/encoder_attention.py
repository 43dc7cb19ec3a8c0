"""Bidirectional attention for encoders (`models.bert`): each token of a step attends to every token of its
own prompt, which the step holds whole (an encoder's prompts are never split over steps).

A step packs prompts back to back (`cu_q_lens`), so this is attention over the step's T tokens with a
block-diagonal mask: T x T scores a head where the prompts' own blocks would be the sum of their squares, in
one dense product that keeps the tensor cores and XLA's fusions. Long steps (an 8,192-token encoder's) take
their queries in blocks of `QUERY_BLOCK`, so that a head's scores are QUERY_BLOCK x T at a time, not T x T.
Nothing is read from or written to the KV pages.
"""

import jax
import jax.numpy as jnp

QUERY_BLOCK = 512


def token_rows(cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:  # i32[T]
    """Each packed token's prompt (row); padding tokens past `cu_q_lens[-1]` get R, a row of their own."""
    return jnp.searchsorted(cu_q_lens, jnp.arange(num_tokens, dtype=cu_q_lens.dtype), side="right") - 1


def encoder_attention(
    q: jax.Array,  # [T, N, H]
    k: jax.Array,  # [T, N, H]
    v: jax.Array,  # [T, N, H]
    rows: jax.Array,  # i32[T]: each token's prompt (`token_rows`)
    sm_scale: float | None = None,
    query_block: int = QUERY_BLOCK,
) -> jax.Array:  # [T, N, H]
    """Softmax attention of each token over the tokens of its own row, both ways (`sm_scale` defaults to
    1 / sqrt(H)); scores and softmax in float32. Padding tokens attend among themselves: finite, and read by
    no one. Queries go `query_block` at a time where T is a multiple of more than one block."""

    def attend(first: int, last: int) -> jax.Array:  # the queries [first, last)
        same_row = rows[first:last, None] == rows[None, :]  # bool[B, T]
        return jax.nn.dot_product_attention(q[None, first:last], k[None], v[None], mask=same_row[None, None],
                                            scale=sm_scale)[0]

    num_tokens = q.shape[0]
    if num_tokens <= query_block or num_tokens % query_block:
        return attend(0, num_tokens)
    return jnp.concatenate([attend(first, first + query_block) for first in range(0, num_tokens, query_block)])
