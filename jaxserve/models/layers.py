"""Pieces the model files share: parameters, norms, rotary embedding, paged attention metadata."""

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from jaxserve.ops import cpu_kernels
from jaxserve.ops.attention import AttentionConfig, ragged_paged_attention
from jaxserve.ops.kv_write import write_kv
from jaxserve.parallel import TP_AXIS

KVCache = list[tuple[jax.Array, jax.Array]]  # per layer: (k_pages, v_pages), each [K, pages, page_size, H]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    """Where each packed token's K/V goes and what each request attends to."""

    slot_mapping: jax.Array  # i32[T]
    kv_lens: jax.Array  # i32[R]
    page_table: jax.Array  # i32[R, P]
    cu_q_lens: jax.Array  # i32[R+1]
    # Static (part of the compile key): every request has exactly one query token, token r is request r's.
    decode_only: bool = field(default=False, metadata=dict(static=True))


def param(*shape: int, dtype: Any) -> nnx.Param:
    """A parameter placeholder; real values are streamed in by the loader."""
    return nnx.Param(jnp.zeros(shape, dtype))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: Any) -> None:
        self.scale = param(dim, dtype=dtype)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: Any) -> None:
        self.scale = param(dim, dtype=dtype)
        self.bias = param(dim, dtype=dtype)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = x32.mean(axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(hf_config: Any, head_dim: int) -> np.ndarray:
    """Inverse frequencies f32[H/2] for the config's RoPE variant (default, linear, llama3)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:  # transformers < 5 spelling
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", 10000.0))
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if rope_type == "default":
        pass
    elif rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(is_medium, smoothed, scaled)
    else:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates x [T, N, H] by positions i32[T] (the rotate-half layout HF Llama uses)."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, H/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


# Up to this many rows a bfloat16 matmul runs in the native kernel, beyond it in XLA's own bfloat16 dot
# with float32 sums: at 1 row XLA's takes 20x the native kernel's time (it reads 2 GB/s), at 16-64 rows it
# runs the MLP projections and the LM head up to 2.7x faster, and a 512-token chunk's 1.4x
# (`benchmarks/cpu_matmul.py`, docs/benchmarks.md). Both: bfloat16 operands, float32 sums and result.
NATIVE_MATMUL_MAX_ROWS = 8
# The native LM head (dot products over the [V, D] table) wins at 1-3 rows (1.7-1.8 ms against 32 at one
# row, 2.0-2.5 at two or three) and loses from 4 on (2.9 against 2.1-2.4).
NATIVE_LM_HEAD_MAX_ROWS = 3


def _native(rows: int, w: jax.Array, attention: AttentionConfig, max_rows: int) -> bool:
    return attention.native_matmuls and w.dtype == jnp.bfloat16 and rows <= max_rows


def dense(x: jax.Array, w: jax.Array, attention: AttentionConfig) -> jax.Array:  # [T, K] x [K, N] -> [T, N]
    """x @ w, in x's dtype. bfloat16 weights' few-row matmuls on a CPU with the native kernels
    (`AttentionConfig.native_matmuls`) go through `cpu_kernels.matmul_bf16`, which streams the weights at
    the memory's speed; XLA:CPU's bfloat16 dot reads them at a twentieth of it there.

    Weights in another dtype than x (`ModelConfig.weight_dtype`) take x rounded to theirs, as llama.cpp
    rounds activations for its 16-bit weights, and sum in float32: a mixed dot would widen every weight
    matrix, every step."""
    if _native(x.shape[0], w, attention, NATIVE_MATMUL_MAX_ROWS):
        return cpu_kernels.matmul_bf16(x.astype(jnp.bfloat16), w).astype(x.dtype)
    if w.dtype != x.dtype or (attention.native_matmuls and w.dtype == jnp.bfloat16):  # float32 sums
        return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32).astype(x.dtype)
    return x @ w


def logits_from_embeddings(hidden: jax.Array, table: jax.Array, attention: AttentionConfig) -> jax.Array:
    """hidden [R, D] times an output-major table [V, D] (the LM head, or tied embeddings): f32[R, V], summed
    in float32 whatever the table's dtype (bfloat16 weights' logits are not rounded to bfloat16)."""
    if _native(hidden.shape[0], table, attention, NATIVE_LM_HEAD_MAX_ROWS):
        return cpu_kernels.matmul_bf16(hidden.astype(jnp.bfloat16), table, output_major_w=True)
    return jnp.einsum("RD,VD->RV", hidden.astype(table.dtype), table, preferred_element_type=jnp.float32)


def project_heads(
    x: jax.Array,  # [T, D]
    w: jax.Array,  # [D, N, H]
    attention: AttentionConfig,
) -> jax.Array:  # [T, N, H]
    """x times a per-head projection as one 2-D matmul: XLA:CPU runs it 3-6x faster than the 3-D einsum
    (which it lowers to a slower dot) at one to 64 tokens. A free reshape; under tensor parallelism the
    head axis stays the major, split part of the flattened axis."""
    return dense(x, w.reshape(w.shape[0], -1), attention).reshape(x.shape[0], *w.shape[1:])


def merge_heads(
    x: jax.Array,  # [T, N, H]
    w: jax.Array,  # [N, H, D]
    attention: AttentionConfig,
) -> jax.Array:  # [T, D]
    """The output projection over all heads as one 2-D matmul (see `project_heads`)."""
    return dense(x.reshape(x.shape[0], -1), w.reshape(-1, w.shape[-1]), attention)


def embedding_lookup(
    table: jax.Array,  # [V, D], split by vocabulary rows over the mesh's devices when it has one
    ids: jax.Array,  # i32[T]
    mesh: Any = None,
) -> jax.Array:  # [T, D]
    """Rows of an embedding table. With a mesh, each device looks up the ids in its own vocabulary range
    and one all-reduce adds the rows up (Megatron's vocab-parallel embedding); left to sharding
    propagation, XLA all-gathers the whole table in some buckets (1 GiB a step for Llama-3-8B)."""
    if mesh is None or table.shape[0] % mesh.size:
        return table[ids]

    def local(rows: jax.Array, ids: jax.Array) -> jax.Array:
        first = jax.lax.axis_index(TP_AXIS) * rows.shape[0]
        local_ids = ids - first
        mine = (local_ids >= 0) & (local_ids < rows.shape[0])
        found = rows[jnp.clip(local_ids, 0, rows.shape[0] - 1)]
        return jax.lax.psum(jnp.where(mine[:, None], found, jnp.zeros_like(found)), TP_AXIS)

    return jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(TP_AXIS, None), PartitionSpec()),
                         out_specs=PartitionSpec(), check_vma=False)(table, ids)


def paged_attention(
    q: jax.Array,  # [T, N, H]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    kv_cache: tuple[jax.Array, jax.Array],
    md: AttentionMetadata,
    *,
    attention: AttentionConfig,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Writes this step's K/V into the pages, then attends over them. Returns [T, N, H] and the cache.

    With a mesh, each device does this for its own heads and pages (`shard_map`): q, k and v arrive
    split by head, the pages by KV head, and the metadata whole.
    """
    def attend(q, k, v, kv_cache, md):  # one device's heads and pages, or all of them
        write = cpu_kernels.write_kv if attention.impl == "cpu-native" else write_kv
        k_pages, v_pages = write(*kv_cache, k, v, md.slot_mapping)
        out = ragged_paged_attention(
            q, k_pages, v_pages, md.kv_lens, md.page_table, md.cu_q_lens,
            sm_scale=1.0 / math.sqrt(q.shape[-1]), impl=attention.impl, num_sms=attention.num_sms,
            decode_only=md.decode_only,
        )
        return out, (k_pages, v_pages)

    if attention.mesh is None:
        return attend(q, k, v, kv_cache, md)
    heads, pages = PartitionSpec(None, TP_AXIS, None), PartitionSpec(TP_AXIS)
    per_shard = jax.shard_map(
        attend, mesh=attention.mesh,
        in_specs=(heads, heads, heads, (pages, pages), PartitionSpec()), out_specs=(heads, (pages, pages)),
        check_vma=False,  # the Pallas calls inside carry no varying-axis annotations
    )
    return per_shard(q, k, v, kv_cache, md)
