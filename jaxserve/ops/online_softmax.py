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


def soft_cap(scores: jax.Array, cap: float | None) -> jax.Array:
    """Gemma 2's attention-logit soft-capping, `cap * tanh(scores / cap)`, on scaled scores; None: as they are."""
    return scores if cap is None else cap * jnp.tanh(scores / cap)


def in_window(key_pos: jax.Array, query_pos: jax.Array, window: int) -> jax.Array:
    """Whether a key is inside a query's sliding window: HF's rule, the `window` positions up to and
    including the query's own. Causality is checked apart."""
    return key_pos > query_pos - window


def online_softmax(num_blocks: jax.Array, rows: tuple[int, ...], head_dim: int, block: BlockFn,
                   first_block: jax.Array | int = 0, sinks: jax.Array | None = None) -> jax.Array:
    """softmax(scores) @ values over blocks [first_block, num_blocks), f32[*rows, H]; rows that see nothing
    get zeros. `sinks` (f32, broadcastable to `rows`): attention sinks (GPT-OSS), a logit per row that joins
    the softmax's denominator and weighs no value; the running max and denominator start from it."""

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
        jnp.asarray(first_block, jnp.int32),
        jnp.full(rows, MASK_VALUE, jnp.float32) if sinks is None else jnp.broadcast_to(sinks, rows).astype(jnp.float32),
        jnp.zeros(rows, jnp.float32) if sinks is None else jnp.ones(rows, jnp.float32),
        jnp.zeros((*rows, head_dim), jnp.float32),
    )
    _, _, denom, acc = jax.lax.while_loop(lambda c: c[0] < num_blocks, body, init)
    return acc / jnp.where(denom == 0.0, 1.0, denom)[..., None]
