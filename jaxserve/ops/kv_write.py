"""Scatter freshly computed K/V into the paged cache."""

import jax


def write_kv(
    k_pages: jax.Array,  # [K, num_pages, page_size, H]
    v_pages: jax.Array,  # [K, num_pages, page_size, H]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    slot_mapping: jax.Array,  # i32[T]: page_id * page_size + offset; out of range for padding
) -> tuple[jax.Array, jax.Array]:
    """Writes token t's K/V into flat slot `slot_mapping[t]`.

    Padding tokens carry a slot past the end of the cache and are dropped by the scatter, so they
    never touch a page that a request owns.
    """
    num_kv_heads, num_pages, page_size, head_dim = k_pages.shape
    flat_shape = (num_kv_heads, num_pages * page_size, head_dim)

    def scatter(pages: jax.Array, new: jax.Array) -> jax.Array:
        flat = pages.reshape(flat_shape)
        flat = flat.at[:, slot_mapping].set(new.swapaxes(0, 1).astype(pages.dtype), mode="drop")
        return flat.reshape(pages.shape)

    return scatter(k_pages, k), scatter(v_pages, v)


def padding_slot(num_pages: int, page_size: int) -> int:
    """The slot index that padding tokens write to: one past the cache, so the write is dropped."""
    return num_pages * page_size



