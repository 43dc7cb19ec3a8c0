"""Scatter freshly computed K/V into the paged cache."""

import jax
import jax.numpy as jnp


def to_cache_dtype(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`x` in the cache's dtype. FP8 (e4m3) saturates at its largest finite value, +-448, as vLLM's FP8
    cache does with a scale of 1: float8_e4m3fn has no infinity, and a plain cast of a larger value gives NaN."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1:
        limit = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -limit, limit)
    return x.astype(dtype)


def write_kv(
    k_pages: jax.Array,  # [K, num_pages, page_size, H]
    v_pages: jax.Array | None,  # [K, num_pages, page_size, H]; None: the cache keeps K alone
    k: jax.Array,  # [T, K, H]
    v: jax.Array | None,  # [T, K, H]; None with v_pages
    slot_mapping: jax.Array,  # i32[T]: page_id * page_size + offset; out of range for padding
) -> tuple[jax.Array, jax.Array | None]:
    """Writes token t's K/V into flat slot `slot_mapping[t]`; a cache whose values are its keys (`v_pages`
    None: `models.values_are_keys`) takes K alone.

    Padding tokens carry a slot past the end of the cache and are dropped by the scatter, so they
    never touch a page that a request owns.
    """
    num_kv_heads, num_pages, page_size, head_dim = k_pages.shape
    flat_shape = (num_kv_heads, num_pages * page_size, head_dim)

    def scatter(pages: jax.Array, new: jax.Array) -> jax.Array:
        flat = pages.reshape(flat_shape)
        flat = flat.at[:, slot_mapping].set(to_cache_dtype(new.swapaxes(0, 1), pages.dtype), mode="drop")
        return flat.reshape(pages.shape)

    return scatter(k_pages, k), None if v_pages is None else scatter(v_pages, v)


def padding_slot(num_pages: int, page_size: int) -> int:
    """The slot index that padding tokens write to: one past the cache, so the write is dropped."""
    return num_pages * page_size



