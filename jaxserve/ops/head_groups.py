"""Attention over a KV head's query group a part at a time, for kernels whose blocks hold fewer query heads a
KV head than a model has (DeepSeek's latent attention: all of its N heads read one KV head)."""

from collections.abc import Callable

import jax
import jax.numpy as jnp


def in_group_parts(
    attend: Callable[[jax.Array, jax.Array | None], jax.Array],  # (q [T, K * G', H], sinks f32[K * G']) -> out
    # [T, K * G', Hv] (Hv: the values' width, H or fewer)
    q: jax.Array,  # [T, N, H]
    num_kv_heads: int,
    part: int,  # G': query heads of a group a call takes, dividing the group
    sinks: jax.Array | None = None,  # f32[N]
) -> jax.Array:  # [T, N, Hv]
    """`attend` on each part of every group: queries [T, K, G, H] in G / G' calls of [T, K, G', H], each
    reading the same K/V pages; the outputs put back in the heads' order."""
    num_tokens, num_q_heads, head_dim = q.shape
    parts = num_q_heads // num_kv_heads // part
    by_part = q.reshape(num_tokens, num_kv_heads, parts, part, head_dim)
    part_sinks = None if sinks is None else jnp.asarray(sinks).reshape(num_kv_heads, parts, part)
    outs = [attend(by_part[:, :, i].reshape(num_tokens, num_kv_heads * part, head_dim),
                   None if part_sinks is None else part_sinks[:, i].reshape(-1)) for i in range(parts)]
    width = outs[0].shape[-1]  # the values' (explicit: a reshape's -1 cannot be inferred at zero tokens)
    outs = [out.reshape(num_tokens, num_kv_heads, part, width) for out in outs]
    return jnp.stack(outs, axis=2).reshape(num_tokens, num_q_heads, width)
