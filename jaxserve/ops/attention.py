"""The one attention entry point the models call; `impl` picks the implementation."""

from typing import Literal

import jax

from jaxserve.ops.paged_attention_ref import ragged_paged_attention_reference

AttentionImpl = Literal["auto", "reference", "pallas", "interpret"]
ATTENTION_IMPLS: tuple[str, ...] = ("auto", "reference", "pallas", "interpret")


def kv_cache_shape(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of one layer's K (or V) pages: JAX's GPU paged-attention layout."""
    return (num_kv_heads, num_pages, page_size, head_dim)


def resolve_impl(impl: str) -> str:
    """Maps `auto` to a concrete implementation for the default backend."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose from {', '.join(ATTENTION_IMPLS)}")
    if impl == "auto":
        return "reference"  # The Pallas GPU kernel is not built yet; see the kernel issue.
    if impl in ("pallas", "interpret"):
        raise NotImplementedError(
            f"attention impl {impl!r} needs the Pallas kernel, which jaxserve does not ship yet; "
            "use 'reference' or 'auto'"
        )
    return impl


def ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [K, num_pages, page_size, H]
    v_pages: jax.Array,  # [K, num_pages, page_size, H]
    kv_lens: jax.Array,  # i32[R]
    page_table: jax.Array,  # i32[R, P]
    cu_q_lens: jax.Array,  # i32[R+1]
    *,
    sm_scale: float,
    impl: str = "auto",
) -> jax.Array:  # [T, N, H]
    """Causal attention of packed ragged queries over each request's paged K/V.

    Request r's queries are tokens `cu_q_lens[r]:cu_q_lens[r+1]`, the last positions of its `kv_lens[r]`
    cached tokens; its pages are `page_table[r, :ceil(kv_lens[r] / page_size)]`. Tokens past
    `cu_q_lens[-1]` are padding and come back as zeros.
    """
    resolve_impl(impl)
    return ragged_paged_attention_reference(
        q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, sm_scale=sm_scale
    )
