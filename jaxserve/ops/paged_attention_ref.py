"""Ragged paged attention in plain jnp: the reference for kernels and the CPU serving path.

Queries of all requests are packed along one token axis; request r owns tokens
`cu_q_lens[r]:cu_q_lens[r+1]`, which are the *last* q_len positions of its `kv_lens[r]` cached tokens
(its new K/V are already written into the pages). Each token attends causally to its own request's pages
(within a sliding window, for models with one).

The loop walks the batch's pages in blocks with an online softmax and stops after the longest request's
last page, so the cost follows the live context, not `max_model_len`. Each token gathers its own
request's block, which keeps GQA native (queries grouped per KV head, K/V never repeated).
"""

import jax
import jax.numpy as jnp

from jaxserve.ops.online_softmax import in_window, online_softmax, soft_cap


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [K, num_pages, page_size, H]
    v_pages: jax.Array,  # [K, num_pages, page_size, H]
    kv_lens: jax.Array,  # i32[R]
    page_table: jax.Array,  # i32[R, P]
    cu_q_lens: jax.Array,  # i32[R+1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,  # f32[N]
    pages_per_block: int = 8,
) -> jax.Array:  # [T, N, H]
    """`sliding_window`: a query sees only the keys at most `sliding_window - 1` positions before it;
    `logit_softcap`: scaled scores pass through `cap * tanh(s / cap)` before the softmax (Gemma 2);
    `sinks`: each query head's attention-sink logit, in the softmax's denominator only (GPT-OSS)."""
    q, k_pages, v_pages, kv_lens, page_table, cu_q_lens = map(
        jnp.asarray, (q, k_pages, v_pages, kv_lens, page_table, cu_q_lens)
    )
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    num_reqs, max_pages = page_table.shape
    group = num_q_heads // num_kv_heads
    pages_per_block = min(pages_per_block, max_pages)
    block_len = pages_per_block * page_size

    # Which request each packed token belongs to, and its absolute position in that request.
    token_idx = jnp.arange(num_tokens, dtype=jnp.int32)
    # All pairs compared (T x R, a small kernel): searchsorted's default is a while loop, which XLA:GPU drives
    # from the host, reading its predicate back at every iteration, a sync in each layer where a GPU takes this path.
    req_of_token = jnp.searchsorted(cu_q_lens[1:], token_idx, side="right", method="compare_all").astype(jnp.int32)
    is_real_token = token_idx < cu_q_lens[num_reqs]
    req_of_token = jnp.minimum(req_of_token, num_reqs - 1)  # i32[T]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # i32[R]
    kv_len_of_token = jnp.where(is_real_token, kv_lens[req_of_token], 0)  # i32[T]
    pos_of_token = jnp.where(
        is_real_token, kv_len_of_token - q_lens[req_of_token] + (token_idx - cu_q_lens[req_of_token]), -1
    )  # i32[T]; -1 makes padding tokens see nothing

    # Pad the page table so the last block's gather stays in range; padded columns are masked.
    num_blocks_max = -(-max_pages // pages_per_block)
    pad_cols = num_blocks_max * pages_per_block - max_pages
    token_pages = jnp.pad(page_table, ((0, 0), (0, pad_cols)))[req_of_token]  # i32[T, P']

    qg = (q.astype(jnp.float32) * sm_scale).reshape(num_tokens, num_kv_heads, group, head_dim)
    max_kv_len = jnp.max(jnp.where(is_real_token, kv_len_of_token, 0))
    num_blocks = (max_kv_len + block_len - 1) // block_len

    def block(index: jax.Array):
        pages = jax.lax.dynamic_slice_in_dim(token_pages, index * pages_per_block, pages_per_block, 1)
        k = k_pages[:, pages].astype(jnp.float32)  # [K, T, B, page_size, H]
        v = v_pages[:, pages].astype(jnp.float32)
        k = k.reshape(num_kv_heads, num_tokens, block_len, head_dim)
        v = v.reshape(num_kv_heads, num_tokens, block_len, head_dim)
        key_pos = index * block_len + jnp.arange(block_len, dtype=jnp.int32)  # i32[S]
        visible = key_pos[None, :] <= pos_of_token[:, None]  # [T, S]
        if sliding_window is not None:
            visible &= in_window(key_pos[None, :], pos_of_token[:, None], sliding_window)
        # Slots past a request's length hold stale or uninitialised data (even NaN): zero them so that
        # 0 * garbage cannot leak into the sums.
        v = jnp.where(visible[None, :, :, None], v, 0.0)
        s = soft_cap(jnp.einsum("tkgh,ktsh->tkgs", qg, k), logit_softcap)  # [T, K, G, S]
        return s, visible[:, None, None, :], lambda p: jnp.einsum("tkgs,ktsh->tkgh", p, v)

    head_sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(num_kv_heads, group)
    out = online_softmax(num_blocks, (num_tokens, num_kv_heads, group), head_dim, block,
                         sinks=head_sinks)  # nothing visible -> 0
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
