"""Native CPU kernels: C++ sources built on first use for this machine and called as XLA FFI custom calls.

XLA:CPU has no paged-attention primitive: expressed in jnp, a step gathers each work item's K/V pages into
blocks and runs small batched dots over them, for every item the bucket's shape allows, live or padding;
a decode's attention reaches a fraction of the memory bandwidth that bounds it. `ragged_paged_attention.cc`
walks each request's pages in place instead, with work that follows the step's live tokens.

The sources ship with the package and are compiled here, as llama.cpp and Triton compile for the machine
they run on: `-march=native` picks up AVX-512 (or not) without a dispatch layer of our own. The build and
its cache are `ops/kernel_build.py`'s. Registration happens once per process, when a step that uses a
kernel is first traced.

Without a C++ compiler (or when the build fails) `kernel_error()` says why and `auto` attention keeps the
jnp CPU path; asking for `cpu-native` explicitly is then an error.
"""

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.ops import kernel_build
from jaxserve.ops.head_groups import in_group_parts
from jaxserve.ops.kernel_build import NativeKernelUnavailable

# FFI target name -> the library's handler symbol.
TARGETS = {
    "jaxserve_ragged_paged_attention": "JaxserveRaggedPagedAttention",
    "jaxserve_matmul_bf16": "JaxserveMatmulBf16",
    "jaxserve_matmul_bf16_nt": "JaxserveMatmulBf16Nt",
    "jaxserve_grouped_matmul_bf16": "JaxserveGroupedMatmulBf16",
    "jaxserve_matmul_gguf": "JaxserveMatmulGguf",
    "jaxserve_grouped_matmul_gguf": "JaxserveGroupedMatmulGguf",
    "jaxserve_write_pages": "JaxserveWritePages",
}


@functools.cache
def _load() -> str | None:
    """Builds (or finds) and registers the kernels once per process; the reason they are missing, or None."""
    try:
        library = ctypes.cdll.LoadLibrary(str(kernel_build.built_library()))
    except (NativeKernelUnavailable, OSError) as error:
        return str(error)
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return None


def kernel_error() -> str | None:
    """Why the native kernels are unavailable on this machine, or None when they are built and registered."""
    return _load()


def ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [K, num_pages, page_size, H]
    v_pages: jax.Array | None,  # [K, num_pages, page_size, H], or None: the keys are the values too
    kv_lens: jax.Array,  # i32[R]
    page_table: jax.Array,  # i32[R, P]
    cu_q_lens: jax.Array,  # i32[R+1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,  # f32[N]: attention sinks (GPT-OSS)
    value_dims: int | None = None,  # with v_pages None: the values are the keys' first value_dims dims
) -> jax.Array:  # [T, N, Hv]: Hv is value_dims, or H
    """`ragged_paged_attention_reference`'s contract; q float32 or bfloat16, the cache float32, bfloat16 or
    float16 (read as stored; scores and sums in float32). A group of more query heads a KV head than a unit
    holds (DeepSeek's latent attention: all N heads on one) is attended a part of the group at a time. With
    `v_pages` None each block of keys is read once for both products, and only the values' dims are summed."""
    if (error := _load()) is not None:
        raise NativeKernelUnavailable(error)
    if value_dims is not None and v_pages is not None:
        raise ValueError("value_dims: the values are the keys' first dims, with v_pages None")
    num_kv_heads = k_pages.shape[0]
    group = q.shape[1] // num_kv_heads
    if group > MAX_GROUP and group % MAX_GROUP == 0:
        return in_group_parts(lambda q, sinks: ragged_paged_attention(
            q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, sm_scale=sm_scale, sliding_window=sliding_window,
            logit_softcap=logit_softcap, sinks=sinks, value_dims=value_dims), q, num_kv_heads, MAX_GROUP, sinks)
    out_shape = (*q.shape[:2], value_dims or q.shape[2])
    values = jnp.zeros((0,), k_pages.dtype) if v_pages is None else v_pages  # no elements: the keys
    call = jax.ffi.ffi_call("jaxserve_ragged_paged_attention", jax.ShapeDtypeStruct(out_shape, q.dtype))
    return call(q, k_pages, values, kv_lens.astype(jnp.int32), page_table.astype(jnp.int32),
                cu_q_lens.astype(jnp.int32),
                jnp.zeros((0,), jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32),
                sm_scale=np.float32(sm_scale),
                sliding_window=np.int32(sliding_window or 0), logit_softcap=np.float32(logit_softcap or 0.0))


def matmul_bf16(
    x: jax.Array,  # bf16[M, K]
    w: jax.Array,  # bf16[K, N], or bf16[N, K] with output_major_w
    *,
    output_major_w: bool = False,
) -> jax.Array:  # f32[M, N]
    """x @ w (x @ w.T with `output_major_w`) from bfloat16 operands with float32 sums (`matmul_bf16.cc`)."""
    if (error := _load()) is not None:
        raise NativeKernelUnavailable(error)
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16 or x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"matmul_bf16 takes 2-D bfloat16 operands, got {x.dtype}{x.shape} and {w.dtype}{w.shape}")
    n = w.shape[0] if output_major_w else w.shape[1]
    target = "jaxserve_matmul_bf16_nt" if output_major_w else "jaxserve_matmul_bf16"
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(x, w)


def grouped_matmul_bf16(
    rows: jax.Array,  # bf16[A, K], sorted by group
    w: jax.Array,  # bf16[G, K, N]
    group_sizes: jax.Array,  # i32[G]: rows of each group, in order; rows past their sum come back as zeros
) -> jax.Array:  # f32[A, N]
    """rows[group g] @ w[g] for every group, from bfloat16 operands with float32 sums (`matmul_bf16.cc`):
    `jax.lax.ragged_dot`'s contract, with work that follows the rows. XLA:CPU computes a ragged dot densely,
    every row against every group's weights."""
    if (error := _load()) is not None:
        raise NativeKernelUnavailable(error)
    if rows.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16 or rows.ndim != 2 or w.ndim != 3:
        raise ValueError(f"grouped_matmul_bf16 takes bfloat16 rows [A, K] and weights [G, K, N], got "
                         f"{rows.dtype}{rows.shape} and {w.dtype}{w.shape}")
    if group_sizes.shape != w.shape[:1] or rows.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_matmul_bf16: rows {rows.shape} and weights {w.shape} do not contract, or "
                         f"{group_sizes.shape} group sizes for {w.shape[0]} groups")
    call = jax.ffi.ffi_call("jaxserve_grouped_matmul_bf16", jax.ShapeDtypeStruct((rows.shape[0], w.shape[2]),
                                                                                 jnp.float32))
    return call(rows, w, group_sizes.astype(jnp.int32))


MAX_GROUP = 64  # query heads a KV head in one of the attention kernel's units (its kMaxRows)

# GGUF block formats the native matmul multiplies by (ggml's type numbers, `matmul_gguf.cc`).
GGUF_KINDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13,
              "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23}


def matmul_gguf(
    x: jax.Array,  # f32[M, K]
    w: jax.Array,  # u8[ceil(N / 16), group_bytes]: GGUF blocks packed by `gguf_packing.pack`
    kind: str,  # a key of GGUF_KINDS
    n: int,  # output features
) -> jax.Array:  # f32[M, N]
    """x @ W.T with W kept in a GGUF file's blocks: x rounded to 8 bits per block of 32, integer dot products per
    block, float32 sums (`matmul_gguf.cc`)."""
    if (error := _load()) is not None:
        raise NativeKernelUnavailable(error)
    if x.ndim != 2 or w.ndim != 2 or w.dtype != jnp.uint8:
        raise ValueError(f"matmul_gguf takes x [M, K] and packed u8 blocks [groups, bytes], got {x.shape} and "
                         f"{w.dtype}{w.shape}")
    if w.shape[0] != -(-n // 16):
        raise ValueError(f"matmul_gguf: {n} output features are {-(-n // 16)} groups of 16, not {w.shape[0]}")
    call = jax.ffi.ffi_call("jaxserve_matmul_gguf", jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x.astype(jnp.float32), w, kind=np.int32(GGUF_KINDS[kind]))


def grouped_matmul_gguf(
    rows: jax.Array,  # f32[A, K], sorted by group
    w: jax.Array,  # u8[G, ceil(N / 16), group_bytes]: each group's GGUF blocks packed by `gguf_packing.pack`
    group_sizes: jax.Array,  # i32[G]: rows of each group, in order; rows past their sum come back as zeros
    kind: str,  # a key of GGUF_KINDS
    n: int,  # output features
) -> jax.Array:  # f32[A, N]
    """rows[group g] @ W[g].T for every group, W kept in a GGUF file's blocks: `matmul_gguf`'s arithmetic
    (x rounded to 8 bits per block of 32) with work that follows the rows (`matmul_gguf.cc`)."""
    if (error := _load()) is not None:
        raise NativeKernelUnavailable(error)
    if rows.ndim != 2 or w.ndim != 3 or w.dtype != jnp.uint8:
        raise ValueError(f"grouped_matmul_gguf takes rows [A, K] and packed u8 blocks [G, groups, bytes], got "
                         f"{rows.shape} and {w.dtype}{w.shape}")
    if w.shape[1] != -(-n // 16) or group_sizes.shape != w.shape[:1]:
        raise ValueError(f"grouped_matmul_gguf: {n} output features in {w.shape[1]} groups of 16, or "
                         f"{group_sizes.shape} sizes for {w.shape[0]} groups of weights")
    call = jax.ffi.ffi_call("jaxserve_grouped_matmul_gguf", jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32))
    return call(rows.astype(jnp.float32), w, group_sizes.astype(jnp.int32), kind=np.int32(GGUF_KINDS[kind]))


def write_kv(
    k_pages: jax.Array,  # [K, num_pages, page_size, H]
    v_pages: jax.Array | None,  # [K, num_pages, page_size, H]; None: the cache keeps K alone
    k: jax.Array,  # [T, K, H]
    v: jax.Array | None,  # [T, K, H]
    slot_mapping: jax.Array,  # i32[T]: page_id * page_size + offset; out of range for padding
) -> tuple[jax.Array, jax.Array | None]:
    """`ops.kv_write.write_kv`'s contract, in place (`write_kv.cc`): each cache buffer becomes its output."""
    if (error := _load()) is not None:
        raise NativeKernelUnavailable(error)
    slots = slot_mapping.astype(jnp.int32)

    def write(pages: jax.Array, rows: jax.Array) -> jax.Array:
        call = jax.ffi.ffi_call("jaxserve_write_pages", jax.ShapeDtypeStruct(pages.shape, pages.dtype),
                                input_output_aliases={0: 0})
        return call(pages, rows.astype(pages.dtype), slots)

    return write(k_pages, k), None if v_pages is None else write(v_pages, v)
