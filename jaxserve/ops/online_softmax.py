"""Softmax attention accumulated block by block (flash attention's online softmax), for the jnp paths.

Both the reference and the CPU path walk K/V in blocks inside a `while_loop` whose trip count is the
longest live context; they differ only in how a block's scores are laid out and computed. Each gives a
`block` function; this keeps the running maximum, denominator and weighted sum.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

MASK_VALUE = -1e30

# block index -> (scores f32[*rows, S], visible bool broadcastable to the scores, p f32[*rows, S] -> f32[*rows, H])
BlockFn = Callable[[jax.Array], tuple[jax.Array, jax.Array, Callable[[jax.Array], jax.Array]]]


def online_softmax(num_blocks: jax.Array, rows: tuple[int, ...], head_dim: int, block: BlockFn) -> jax.Array:
    """softmax(scores) @ values over `num_blocks` blocks, f32[*rows, H]; rows that see nothing get zeros."""

    def body(carry):
        index, m, denom, acc = carry
        s, visible, weigh_values = block(index)
        s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))  # [*rows]
        p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
        correction = jnp.exp(m - m_new)
        denom = denom * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + weigh_values(p)
        return index + 1, m_new, denom, acc

    init = (
        jnp.int32(0),
        jnp.full(rows, MASK_VALUE, jnp.float32),
        jnp.zeros(rows, jnp.float32),
        jnp.zeros((*rows, head_dim), jnp.float32),
    )
    _, _, denom, acc = jax.lax.while_loop(lambda c: c[0] < num_blocks, body, init)
    return acc / jnp.where(denom == 0.0, 1.0, denom)[..., None]
