"""Ragged paged attention for XLA:CPU: each K/V block is read once per query block, not once per token.

The reference (`paged_attention_ref`) gathers a block of its request's K/V for every query token, which is
what a decode needs but makes a prefill chunk of T tokens read its context T times (an 8k-token prompt
moved gigabytes per layer). Here the packed tokens are cut into *work items*: runs of at most `query_block`
consecutive tokens of one request. Every item gathers its request's K/V block once and multiplies all its
queries (times the GQA group) against it in one dot, so a chunk reads its context T / query_block times and
the dots are [query_block * group, H] x [H, S] instead of matrix-vector products.

A step of T tokens from R requests has at most ceil(T / query_block) + R items (each request adds at most
one partial item), a static count, so the work list is computed inside the step from `cu_q_lens`. The
block size follows the bucket (`default_query_block`): large for a few long chunks, 1 when the step is
mostly decodes. Decode-only steps (one token per request) use `query_block = 1`: one item per request.

The loop over K/V blocks uses an online softmax and stops after the longest item's last visible key, so
cost follows the live context, not `max_model_len`. Results agree with the reference to float32 rounding.
"""

import jax
import jax.numpy as jnp

from jaxserve.ops.online_softmax import in_window, online_softmax, soft_cap


def default_query_block(num_tokens: int, num_reqs: int) -> int:
    """Tokens per item for a bucket: the largest power of two up to T / (2R), or 1 below 4.

    Larger items read the context fewer times (a lone 512-token chunk reads it twice, not 512 times),
    but every item computes all its rows, and the R possible partial items can be mostly padding; with
    R x block <= T / 2 the padded rows stay under half the real ones.
    """
    block = 1
    while block * 2 * 2 * num_reqs <= num_tokens:
        block *= 2
    return block if block >= 4 else 1


def num_work_items(num_tokens: int, num_reqs: int, query_block: int) -> int:
    """The static item count for a bucket: whole blocks of tokens plus one partial block per request."""
    if query_block == 1:
        return num_tokens
    return -(-num_tokens // query_block) + num_reqs


def ragged_paged_attention_cpu(
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
    sinks: jax.Array | None = None,  # f32[N]: attention sinks, as the reference takes them
    query_block: int | None = None,
    pages_per_block: int = 8,
    decode_only: bool = False,
) -> jax.Array:  # [T, N, H]
    """Same contract as `ragged_paged_attention_reference`; `decode_only` promises every request has one
    query (so items of one token). `query_block`: tokens per item (default: `default_query_block`).
    With a `sliding_window` the loop starts at the block holding the earliest key any item can see."""
    q, k_pages, v_pages, kv_lens, page_table, cu_q_lens = map(
        jnp.asarray, (q, k_pages, v_pages, kv_lens, page_table, cu_q_lens)
    )
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    num_reqs, max_pages = page_table.shape
    group = num_q_heads // num_kv_heads
    if query_block is None:
        query_block = default_query_block(num_tokens, num_reqs)
    query_block = 1 if decode_only else min(query_block, num_tokens)
    pages_per_block = min(pages_per_block, max_pages)
    block_len = pages_per_block * page_size
    num_items = num_work_items(num_tokens, num_reqs, query_block)

    # The work list: item w covers tokens item_start[w] : item_start[w] + item_len[w] of request item_req[w].
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # i32[R]
    blocks_of_req = -(-q_lens // query_block)  # i32[R]
    first_block_of_req = jnp.cumsum(blocks_of_req) - blocks_of_req  # i32[R]
    items = jnp.arange(num_items, dtype=jnp.int32)
    item_req = jnp.searchsorted(first_block_of_req + blocks_of_req, items, side="right").astype(jnp.int32)
    real_item = item_req < num_reqs
    item_req = jnp.minimum(item_req, num_reqs - 1)  # i32[W]
    offset_in_req = (items - first_block_of_req[item_req]) * query_block
    item_start = cu_q_lens[item_req] + offset_in_req  # i32[W]
    item_len = jnp.where(real_item, jnp.clip(q_lens[item_req] - offset_in_req, 0, query_block), 0)

    # Each item's queries and their absolute positions; -1 marks padding rows, which see nothing.
    row = jnp.arange(query_block, dtype=jnp.int32)
    token_of = jnp.minimum(item_start[:, None] + row[None, :], num_tokens - 1)  # i32[W, Q]
    real_row = row[None, :] < item_len[:, None]  # bool[W, Q]
    item_kv_len = kv_lens[item_req]  # i32[W]
    first_pos = item_kv_len - q_lens[item_req] + (item_start - cu_q_lens[item_req])  # i32[W]
    query_pos = jnp.where(real_row, first_pos[:, None] + row[None, :], -1)  # i32[W, Q]

    rows = group * query_block  # an item's query rows per KV head, in (g, q) order
    qs = (q.astype(jnp.float32) * sm_scale)[token_of]  # [W, Q, N, H]
    qs = qs.reshape(num_items, query_block, num_kv_heads, group, head_dim).transpose(2, 0, 3, 1, 4)
    qs = qs.reshape(num_kv_heads, num_items, rows, head_dim)  # [K, W, G*Q, H]

    num_blocks_max = -(-max_pages // pages_per_block)
    item_pages = jnp.pad(page_table, ((0, 0), (0, num_blocks_max * pages_per_block - max_pages)))[item_req]
    visible_len = jnp.max(jnp.where(item_len > 0, first_pos + item_len, 0))  # keys any item can see
    num_blocks = (visible_len + block_len - 1) // block_len
    first_block = jnp.int32(0)
    if sliding_window is not None:  # keys before every item's window are never read
        earliest = jnp.min(jnp.where(item_len > 0, first_pos - sliding_window + 1, visible_len))
        first_block = jnp.clip(earliest, 0, None) // block_len
    row_pos = jnp.tile(query_pos, (1, group))  # i32[W, G*Q]

    def gather(pages_of: jax.Array, block_pages: jax.Array) -> jax.Array:  # -> f32[K, W, S, H]
        # Page ids come from the page table, so they are in range: no bounds handling in the gather.
        rows = pages_of.at[:, block_pages].get(mode="promise_in_bounds")  # [K, W, B, page_size, H]
        return rows.astype(jnp.float32).reshape(num_kv_heads, num_items, block_len, head_dim)

    def scores(qs: jax.Array, k: jax.Array) -> jax.Array:  # [K, W, G*Q, H] x [K, W, S, H] -> [K, W, G*Q, S]
        if rows > 8:
            return jnp.einsum("kwrh,kwsh->kwrs", qs, k)
        # With few rows (decode), XLA:CPU runs the dot 2.5x faster with K as its left operand; the barrier
        # keeps XLA from folding the (small) transpose back into the slow form.
        return jax.lax.optimization_barrier(jnp.einsum("kwsh,kwrh->kwsr", k, qs)).transpose(0, 1, 3, 2)

    def block(index: jax.Array):
        pages = jax.lax.dynamic_slice_in_dim(item_pages, index * pages_per_block, pages_per_block, 1)
        k, v = gather(k_pages, pages), gather(v_pages, pages)
        key_pos = index * block_len + jnp.arange(block_len, dtype=jnp.int32)  # i32[S]
        visible = (key_pos[None, None, :] <= row_pos[..., None])[None]  # bool[1, W, G*Q, S]
        if sliding_window is not None:
            visible &= in_window(key_pos[None, None, :], row_pos[..., None], sliding_window)[None]
        key_in_range = key_pos[None, :] < item_kv_len[:, None]  # bool[W, S]: stale slots may hold NaN
        if sliding_window is not None:  # and so may pages before every window, which the server may free
            key_in_range &= in_window(key_pos[None, :], first_pos[:, None], sliding_window)
        v = jnp.where(key_in_range[None, :, :, None], v, 0.0)
        return soft_cap(scores(qs, k), logit_softcap), visible, lambda p: jnp.einsum("kwrs,kwsh->kwrh", p, v)

    row_sinks = None  # f32[K, 1, G*Q]: each row's head's sink, rows in (g, q) order
    if sinks is not None:
        row_sinks = jnp.repeat(jnp.asarray(sinks, jnp.float32).reshape(num_kv_heads, group), query_block, axis=1)
        row_sinks = row_sinks[:, None, :]
    out = online_softmax(num_blocks, (num_kv_heads, num_items, rows), head_dim, block,
                         first_block=first_block, sinks=row_sinks)  # [K, W, G*Q, H]
    out = out.reshape(num_kv_heads, num_items, group, query_block, head_dim).transpose(1, 3, 0, 2, 4)
    out = out.reshape(num_items * query_block, num_q_heads, head_dim)  # [W*Q, N, H]

    # Back to packed tokens: token t is row t - item_start of its item; padding tokens read zeros.
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    req_of_token = jnp.searchsorted(cu_q_lens[1:], tokens, side="right").astype(jnp.int32)
    req_of_token = jnp.minimum(req_of_token, num_reqs - 1)
    item_of_token = first_block_of_req[req_of_token] + (tokens - cu_q_lens[req_of_token]) // query_block
    item_of_token = jnp.clip(item_of_token, 0, num_items - 1)
    row_of_token = tokens - item_start[item_of_token]
    real_token = tokens < cu_q_lens[num_reqs]
    picked = out[jnp.clip(item_of_token * query_block + row_of_token, 0, num_items * query_block - 1)]
    return jnp.where(real_token[:, None, None], picked, 0.0).astype(q.dtype)
