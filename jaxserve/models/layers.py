"""Pieces the model files share: parameters, norms, rotary embedding, paged attention metadata."""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from jaxserve.models import gguf_weights, quantization
from jaxserve.models.gguf_weights import GgufTable, GgufWeight
from jaxserve.models.quantization import Fp8Weight
from jaxserve.ops import cpu_kernels
from jaxserve.ops.attention import AttentionConfig, ragged_paged_attention, trace_environment
from jaxserve.ops.kv_write import write_kv
from jaxserve.parallel import TP_AXIS

# Per layer: (k_pages, v_pages), each [K, pages, page_size, H]; v_pages None where the values are the keys.
KVCache = list[tuple[jax.Array, jax.Array | None]]


def kv_cache_layers(num_layers: int, keys_only: bool, make_pages: Callable[[], Any]) -> list[tuple[Any, Any]]:
    """A cache of `num_layers` layers: (K pages, V pages) each, or (K pages, None) with `keys_only`; each array
    from `make_pages()` (arrays, or ShapeDtypeStructs for a compile)."""
    return [(make_pages(), None if keys_only else make_pages()) for _ in range(num_layers)]


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


def apply_layers(layers: nnx.List, x: jax.Array, kv_caches: KVCache, **kwargs: Any) -> tuple[jax.Array, KVCache]:
    """`x, kv_cache = layer(x, kv_cache=kv_cache, **kwargs)` for each layer and its cache in turn; returns the
    last `x` and the layers' new caches.

    Each layer is called through one jitted function, `_apply_layer`, whose static arguments are the layer's
    structure (its `nnx.GraphDef`: config, window, rotary embedding) and the environment the attention's
    choice of kernel reads while tracing, and whose traced ones are its weights and inputs. jax keeps a
    nested jit's jaxpr for the process by its static arguments and input types (until evicted or
    `jax.clear_caches()`), and its lowering within the step's module, so a model's identical layers are
    traced and lowered once, Pallas kernels and all, where
    a plain loop traced every layer again: the layers' part of the Python time that every step's compile
    spends before XLA (warm starts included) divided by their number. XLA inlines the calls before its
    first optimization: it compiles the plain loop's computation, its instructions in an order that can
    change a fusion (docs/benchmarks.md, stop 89)."""
    environment = trace_environment()
    new_caches = []
    for layer, kv_cache in zip(layers, kv_caches, strict=True):
        graphdef, state = nnx.split(layer)
        x, kv_cache = _apply_layer(graphdef, environment, state, x, kv_cache, kwargs)
        new_caches.append(kv_cache)
    return x, new_caches


@partial(jax.jit, static_argnums=(0, 1))
def _apply_layer(graphdef: nnx.GraphDef, environment: tuple[str | None, ...], state: nnx.State, x: jax.Array,
                 kv_cache: tuple[jax.Array, jax.Array], kwargs: dict[str, Any]) -> tuple[jax.Array, Any]:
    del environment  # a key only: the kernels read it from the environment while this traces
    return nnx.merge(graphdef, state)(x, kv_cache=kv_cache, **kwargs)


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


@dataclass(frozen=True)
class Rope:
    """A layer's rotary embedding: inverse frequencies for the first 2 * len(inv_freq) dims of each head (the
    rest pass through: partial rotary), and the factor cos and sin are scaled by (YaRN's and LongRoPE's
    attention factor)."""

    inv_freq: tuple[float, ...]
    attention_factor: float = 1.0


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The config's RoPE parameters (those of `layer_type` where a model keys them by layer type, as Gemma 3
    and OLMo 3 do), in transformers 5's spelling. transformers 4 spells OLMo 3's flat and runs its windowed
    layers unscaled: so are they read here."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        return dict(params[layer_type])
    if not params:  # transformers < 5 spelling
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        if getattr(hf_config, "partial_rotary_factor", None):
            params.setdefault("partial_rotary_factor", hf_config.partial_rotary_factor)
    if getattr(hf_config, "model_type", None) == "olmo3" and layer_type == "sliding_attention":  # spelled flat
        params = {"rope_type": "default", "rope_theta": params.get("rope_theta", 10000.0)}
    return params


# RoPE types whose factor does not lengthen the context (vLLM's rule): LongRoPE's and Llama 3's positions
# count the scaled context already.
_CONTEXT_KEPT = ("default", "su", "longrope", "llama3", "mrope")


def context_length(hf_config: Any, max_position_embeddings: int) -> int:
    """The longest context the model serves, by vLLM's rule, never below its position count: a RoPE scaling's
    factor times the positions, or for YaRN times the original context (Qwen's configs, and `--hf-overrides`
    as their model cards give it, keep 32,768 positions beside a YaRN factor of 4 for 131,072 tokens). Where
    RoPE is set per layer type (Gemma 3's linear full layers, whose positions count the scaled context
    already), a YaRN layer type's alone counts (OLMo 3's)."""
    params = rope_parameters(hf_config)
    if params and all(isinstance(v, dict) for v in params.values()):
        longest = [_scaled_context(p, max_position_embeddings) for p in params.values() if p.get("rope_type") == "yarn"]
        return max([max_position_embeddings, *longest])
    return max(max_position_embeddings, _scaled_context(params, max_position_embeddings))


def _scaled_context(params: dict[str, Any], max_position_embeddings: int) -> int:
    rope_type = params.get("rope_type", params.get("type", "default"))
    factor = params.get("factor")
    if rope_type in _CONTEXT_KEPT or not factor:
        return max_position_embeddings
    base = params.get("original_max_position_embeddings") if rope_type == "yarn" else None
    return int((base or max_position_embeddings) * factor)


def rope_for(hf_config: Any, head_dim: int, layer_type: str | None = None) -> Rope:
    """The rotary embedding of the config's RoPE variant: default, linear, llama3, yarn, longrope (Phi-3's
    `su` too). LongRoPE's long factors are taken when the model's context is longer than its original one
    (vLLM's choice too: the factors cannot change mid-sequence once keys are cached, and transformers
    switches them by the current sequence's length)."""
    params = rope_parameters(hf_config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", 10000.0))
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    inv_freq = 1.0 / theta**exponents
    attention_factor = 1.0
    max_len = getattr(hf_config, "max_position_embeddings", None)
    if rope_type == "default":
        pass
    elif rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn(params, inv_freq, rotary_dim, theta, max_len)
    elif rope_type in ("longrope", "su"):
        original = params.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings
        factor = params.get("factor") or max_len / original
        long = max_len > original
        inv_freq = inv_freq / np.asarray(params["long_factor" if long else "short_factor"], np.float64)
        attention_factor = params.get("attention_factor") or (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
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
    return Rope(tuple(inv_freq.astype(np.float32).tolist()), float(attention_factor))


def _yarn(params: dict, inv_freq: np.ndarray, dim: int, theta: float, max_len: int | None) -> tuple[np.ndarray, float]:
    """YaRN (arXiv 2309.00071): frequencies interpolated by `factor` below a ramp of dimensions and kept above
    it, and the attention factor 0.1 ln(factor) + 1 (or DeepSeek's mscale ratio)."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_len / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(params.get("beta_fast") or 32), correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    kept = 1.0 - ramp  # 1: the original frequency (fast dims), 0: interpolated by the factor
    return inv_freq / factor * (1 - kept) + inv_freq * kept, attention_factor


def apply_rope(x: jax.Array, positions: jax.Array, rope: Rope) -> jax.Array:
    """Rotates x [T, N, H] by positions i32[T] (the rotate-half layout HF Llama uses) over the first
    2 * len(inv_freq) dims of each head; the others pass through (partial rotary)."""
    inv_freq = np.asarray(rope.inv_freq, np.float32)
    rotary_dim = 2 * inv_freq.shape[0]
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, R/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    if rope.attention_factor != 1.0:
        cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32[..., :rotary_dim], 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x32[..., rotary_dim:]], axis=-1)
    return rotated.astype(x.dtype)


def layer_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as transformers reads the config: `layer_types`
    where the config lists them (Gemma 2/3's local and global layers, Qwen2's `max_window_layers`), else the
    one `sliding_window` for every layer (Mistral, Phi-3); none where `use_sliding_window` is false."""
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", None) is False:
        return (None,) * num_layers
    if layer_types := getattr(hf_config, "layer_types", None):
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    return (window,) * num_layers


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


def dense(x: jax.Array, w: jax.Array, attention: AttentionConfig,
          split_contracted: bool = False) -> jax.Array:  # [T, K] x [K, N] -> [T, N]
    """x @ w, in x's dtype. bfloat16 weights' few-row matmuls on a CPU with the native kernels
    (`AttentionConfig.native_matmuls`) go through `cpu_kernels.matmul_bf16`, which streams the weights at
    the memory's speed; XLA:CPU's bfloat16 dot reads them at a twentieth of it there.

    Weights in another dtype than x (`ModelConfig.weight_dtype`) take x rounded to theirs, as llama.cpp
    rounds activations for its 16-bit weights, and sum in float32: a mixed dot would widen every weight
    matrix, every step. FP8 weights (`quantization.Fp8Weight`) are widened to x's dtype inside the dot (or, in a
    GPU's large steps, meet x rounded to e4m3: `quantization.activations_in_fp8`), those with block scales in a
    GPU kernel or scaled before it (`quantization.block_matmul`); `split_contracted`: w is a row-parallel
    weight, split along K under a mesh (output and down projections), which FP8 activations quantize per
    device's share (`quantization.w8a8_row_parallel`); a GGUF file's blocks
    (`gguf_weights.GgufWeight`) go to the native kernel that decodes them.

    On a CUDA GPU one row is padded to two: XLA:GPU rewrites a one-row dot as a multiply and a reduction,
    and for many weights of small and mid-sized models (GPT-2's, SmolLM2's and Qwen3-0.6B's output and down
    projections) runs the multiply as a kernel of its own that writes the product, as large as the weight,
    before a second kernel reduces it; two rows make it a GEMM that reads the weight once."""
    if attention.cuda and x.shape[0] == 1:
        return dense(jnp.pad(x, ((0, 1), (0, 0))), w, attention, split_contracted)[:1]
    if isinstance(w, Fp8Weight):
        return quantization.matmul(x, w, attention, split_contracted)
    if isinstance(w, GgufWeight):
        return gguf_weights.matmul(x, w)
    if _native(x.shape[0], w, attention, NATIVE_MATMUL_MAX_ROWS):
        return cpu_kernels.matmul_bf16(x.astype(jnp.bfloat16), w).astype(x.dtype)
    if w.dtype != x.dtype or (attention.native_matmuls and w.dtype == jnp.bfloat16):  # float32 sums
        return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32).astype(x.dtype)
    return x @ w


@dataclass(frozen=True)
class LoraShape:
    """The device's adapter slots (`--max-loras`, `--max-lora-rank`): every LoRA weight is stacked over
    `max_loras` slots of rank `max_rank`, an adapter of a lower rank padded with zeros."""

    max_loras: int
    max_rank: int


class LoraStack(nnx.Module):
    """One projection's LoRA adapters, stacked over the slots: each token adds (x A_s) B_s for its request's
    slot s, none for a token of the base model (a slot no stack has, `step_io.NO_LORA_SLOT`). The scale
    (alpha / r) is in B, folded in when an adapter is written to a slot.

    A step may mix adapters: every token multiplies by all slots' A at once, keeps its own slot's r columns
    (a mask) and multiplies them by all slots' B. Two dense matmuls of max_loras x max_rank columns, whose
    shapes never change with the adapters a step holds: punica's batched LoRA as plain XLA dots, small beside
    the projection they add to (a step's own slot choices are data, so nothing recompiles). Both go through
    `dense`, as the projections do: in the weights' dtype, through the native kernels where those run."""

    def __init__(self, d_in: int, d_out: int, shape: LoraShape, weight_dtype: Any, attention: AttentionConfig) -> None:
        self.lora_a = param(d_in, shape.max_loras, shape.max_rank, dtype=weight_dtype)  # [K, S, r]
        self.lora_b = param(shape.max_loras, shape.max_rank, d_out, dtype=weight_dtype)  # [S, r, N]
        self.attention = attention

    def __call__(
        self,
        x: jax.Array,  # [T, K]
        token_slots: jax.Array,  # i32[T]
    ) -> jax.Array:  # [T, N], in x's dtype
        a, b = self.lora_a[...], self.lora_b[...]
        d_in, num_slots, rank = a.shape
        shrunk = dense(x, a.reshape(d_in, num_slots * rank), self.attention)  # [T, S*r]
        mine = token_slots[:, None] == jnp.arange(num_slots, dtype=token_slots.dtype)[None, :]  # [T, S]
        shrunk = jnp.where(mine[:, :, None], shrunk.reshape(-1, num_slots, rank), 0).reshape(-1, num_slots * rank)
        return dense(shrunk, b.reshape(num_slots * rank, -1), self.attention)


class AttentionLora(nnx.Module):
    """The LoRA stacks of an attention block's q, k, v and o projections (`LoraStack`)."""

    def __init__(self, d: int, n: int, k: int, h: int, shape: LoraShape, weight_dtype: Any,
                 attention: AttentionConfig) -> None:
        self.q = LoraStack(d, n * h, shape, weight_dtype, attention)
        self.k = LoraStack(d, k * h, shape, weight_dtype, attention)
        self.v = LoraStack(d, k * h, shape, weight_dtype, attention)
        self.o = LoraStack(n * h, d, shape, weight_dtype, attention)

    def add_qkv(
        self,
        x: jax.Array,  # [T, D]
        token_slots: jax.Array,  # i32[T]
        q: jax.Array,  # [T, N, H]
        k: jax.Array,  # [T, K, H]
        v: jax.Array,  # [T, K, H]
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        return (q + self.q(x, token_slots).reshape(q.shape), k + self.k(x, token_slots).reshape(k.shape),
                v + self.v(x, token_slots).reshape(v.shape))

    def add_o(
        self,
        y: jax.Array,  # [T, D]: the output projection's
        out: jax.Array,  # [T, N, H]: attention's, its input
        token_slots: jax.Array,  # i32[T]
    ) -> jax.Array:  # [T, D]
        return y + self.o(out.reshape(out.shape[0], -1), token_slots)


class MlpLora(nnx.Module):
    """The LoRA stacks of a gated MLP's gate, up and down projections (`LoraStack`)."""

    def __init__(self, d: int, f: int, shape: LoraShape, weight_dtype: Any, attention: AttentionConfig) -> None:
        self.gate = LoraStack(d, f, shape, weight_dtype, attention)
        self.up = LoraStack(d, f, shape, weight_dtype, attention)
        self.down = LoraStack(f, d, shape, weight_dtype, attention)


_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class GatedMlp(nnx.Module):
    """down(act(gate(x)) * up(x)): Llama's SwiGLU (`silu`) and Gemma's GeGLU (`gelu_tanh`), with the LoRA
    stacks of its three projections under --enable-lora (`lora`, the slots' shape)."""

    def __init__(self, d: int, f: int, weight_dtype: Any, attention: AttentionConfig, lora: LoraShape | None,
                 activation: str) -> None:
        self.gate_proj = param(d, f, dtype=weight_dtype)
        self.up_proj = param(d, f, dtype=weight_dtype)
        self.down_proj = param(f, d, dtype=weight_dtype)
        if lora is not None:
            self.lora = MlpLora(d, f, lora, weight_dtype, attention)
        self.attention = attention
        self.activation = activation  # a key of _ACTIVATIONS

    def __call__(
        self,
        x: jax.Array,  # [T, D]
        lora_slots: jax.Array | None = None,  # i32[T], with --enable-lora
    ) -> jax.Array:  # [T, D]
        gate = dense(x, self.gate_proj[...], self.attention)  # [T, F]
        up = dense(x, self.up_proj[...], self.attention)
        if lora_slots is not None:
            gate, up = gate + self.lora.gate(x, lora_slots), up + self.lora.up(x, lora_slots)
        hidden = _ACTIVATIONS[self.activation](gate) * up
        out = dense(hidden, self.down_proj[...], self.attention, split_contracted=True)
        return out if lora_slots is None else out + self.lora.down(hidden, lora_slots)


# A PEFT adapter's target module, by its name within an HF decoder layer -> the `LoraStack` it fills, within
# the model's layer (`AttentionLora` and `MlpLora` as `self_attn.lora` and `mlp.lora`); a fused target (Phi-3's)
# fills several, its B rows split among them in order (`peft.LoraLayout`).
LORA_TARGETS: dict[str, tuple[str, ...]] = {
    **{f"self_attn.{name}_proj": ("self_attn", "lora", name) for name in ("q", "k", "v", "o")},
    **{f"mlp.{name}_proj": ("mlp", "lora", name) for name in ("gate", "up", "down")},
}
LORA_FUSED_TARGETS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def logits_from_embeddings(hidden: jax.Array, table: jax.Array, attention: AttentionConfig) -> jax.Array:
    """hidden [R, D] times an output-major table [V, D] (the LM head, or tied embeddings): f32[R, V], summed
    in float32 whatever the table's dtype (bfloat16 weights' logits are not rounded to bfloat16). A table kept
    in a GGUF file's blocks goes to the native kernel."""
    if isinstance(table, GgufTable):
        return table.logits(hidden)
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
    return dense(x.reshape(x.shape[0], -1), w.reshape(-1, w.shape[-1]), attention, split_contracted=True)


def embedding_lookup(
    table: jax.Array,  # [V, D], split by vocabulary rows over the mesh's devices when it has one
    ids: jax.Array,  # i32[T]
    mesh: Any = None,
) -> jax.Array:  # [T, D]
    """Rows of an embedding table. With a mesh, each device looks up the ids in its own vocabulary range
    and one all-reduce adds the rows up (Megatron's vocab-parallel embedding); left to sharding
    propagation, XLA all-gathers the whole table in some buckets (1 GiB a step for Llama-3-8B). A table kept in
    a GGUF file's blocks (one device) decodes the ids' rows."""
    if isinstance(table, GgufTable):
        return table.lookup(ids)
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
    v: jax.Array | None,  # [T, K, H]; None: the values are the keys
    kv_cache: tuple[jax.Array, jax.Array | None],
    md: AttentionMetadata,
    *,
    attention: AttentionConfig,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,  # f32[N]
    value_dims: int | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array | None]]:
    """Writes this step's K/V into the pages, then attends over them. Returns [T, N, H] and the cache.
    `sm_scale` defaults to 1 / sqrt(H); a window, a soft cap and attention sinks as in
    `ops.attention.ragged_paged_attention`. With `v` None the values are the keys: the cache is
    (K pages, None) (`models.values_are_keys`), and each key is read once for both; `value_dims`: the values
    are the keys' first dims, and the output [T, N, value_dims].

    With a mesh, each device does this for its own heads and pages (`shard_map`): q, k and v arrive
    split by head, the pages by KV head, and the metadata whole.
    """
    if (v is None) != (kv_cache[1] is None):
        raise ValueError("values are the keys (v None) exactly where the cache keeps K alone (V pages None)")

    def attend(q, k, v, kv_cache, md, sinks=None):  # one device's heads and pages, or all of them
        write = cpu_kernels.write_kv if attention.impl == "cpu-native" else write_kv
        k_pages, v_pages = write(*kv_cache, k, v, md.slot_mapping)
        out = ragged_paged_attention(
            q, k_pages, v_pages, md.kv_lens, md.page_table, md.cu_q_lens,
            sm_scale=sm_scale or 1.0 / math.sqrt(q.shape[-1]), sliding_window=sliding_window,
            logit_softcap=logit_softcap, sinks=sinks, impl=attention.impl, num_sms=attention.num_sms,
            decode_only=md.decode_only,
            hopper=attention.mosaic_attention, hopper_decode=attention.mosaic_decode,
            persistent=attention.mosaic_persistent, hopper_fp8=attention.mosaic_fp8, value_dims=value_dims,
        )
        return out, (k_pages, v_pages)

    if attention.mesh is None:
        return attend(q, k, v, kv_cache, md, sinks)
    heads, pages = PartitionSpec(None, TP_AXIS, None), PartitionSpec(TP_AXIS)
    sinks_specs, sinks_args = ((), ()) if sinks is None else ((PartitionSpec(TP_AXIS),), (sinks,))
    per_shard = jax.shard_map(
        attend, mesh=attention.mesh,
        in_specs=(heads, heads, heads, (pages, pages), PartitionSpec(), *sinks_specs),
        out_specs=(heads, (pages, pages)),
        check_vma=False,  # the Pallas calls inside carry no varying-axis annotations
    )
    return per_shard(q, k, v, kv_cache, md, *sinks_args)
