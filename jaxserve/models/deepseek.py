"""DeepSeek-V2 and V3 (and their architecture's others: Kimi K2, Moonlight) in Flax NNX: multi-head latent
attention (MLA) over a cache of latents, and DeepSeek's mixture of experts.

MLA compresses each token's keys and values into one latent c (`kv_lora_rank` wide, normed) and one RoPE key
k_r (`qk_rope_head_dim`, shared by every head). A head's key is [W_UK c, k_r] and its value W_UV c. The cache
keeps [c, k_r] alone, one "KV head" of C + R dims, and attention runs on it with the up-projections absorbed
into the query and the output (as vLLM's and FlashMLA's decode do):
- q_h . k_h = (W_UK_h^T q_nope_h) . c + q_rope_h . k_r: the query [W_UK_h^T q_nope_h, q_rope_h] against the
  cached [c, k_r], one KV head for all N query heads (a group of N), scaled by (nope + rope)^-1/2 (and YaRN's
  mscale squared, where the config scales RoPE);
- out_h = W_UV_h (sum_s p_hs c_s): the attention's value is the cached vector too, and its first C dims,
  times W_UV_h, are the head's output.
Each token caches C + R values a layer (576 for V2/V3), once: the values are read from the keys' pages
(`models.values_are_keys`), where the heads' own keys and values would take N x (nope + rope + v) (24,576
for V3's 128 heads).

RoPE: DeepSeek rotates adjacent pairs; the rows of the projections that make q_rope and k_r are reordered at
load into the rotate-half layout (`rope_layout`).

The experts: DeepSeek's router (`moe.route_deepseek`: softmax or sigmoid scores, groups, V3's correction
bias, a scaling factor), an ungated shared expert of `n_shared_experts` x the experts' width, and dense MLPs
in the first `first_k_dense_replace` layers.

Axis letters: T tokens, D hidden, N heads, P no-RoPE query/key dims, R RoPE dims, C latent, V value dims,
Q query latent (V3's `q_lora_rank`), F MLP width.
"""

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models import llama
from jaxserve.models.layers import (
    AttentionMetadata,
    GatedMlp,
    RMSNorm,
    Rope,
    apply_rope,
    dense,
    merge_heads,
    paged_attention,
    param,
    project_heads,
    rope_for,
    rope_parameters,
)
from jaxserve.models.moe import ExpertStacker, MoeConfig, SparseMoeBlock
from jaxserve.models.rope_layout import rotate_half_order
from jaxserve.ops.attention import AttentionConfig
from jaxserve.parallel import SplitRule

_LATENT_NORM_EPS = 1e-6  # transformers' DeepSeek norms of the two latents take the norm's default, not the config's


@dataclass(frozen=True)
class DeepseekConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    num_layers: int
    num_heads: int
    q_lora_rank: int | None  # V3: queries through a normed latent of this width; None: one projection (V2-Lite)
    kv_lora_rank: int  # C
    qk_nope_head_dim: int  # P
    qk_rope_head_dim: int  # R
    v_head_dim: int  # V
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope: Rope  # over the R dims
    sm_scale: float  # (P + R)^-1/2, times YaRN's mscale squared where RoPE is scaled
    moe: MoeConfig
    first_dense_layers: int  # `first_k_dense_replace`
    # The cache's KV heads: the latent's one, or under tensor parallelism a copy of it on each device
    # (`jaxserve.parallel.HeadLayout`), each read by that device's query heads
    num_kv_heads: int = 1
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    lora: None = None  # no adapter stacks (--enable-lora is refused)
    embedding_multiplier: float = 1.0  # (Llama's stack reads these: Granite's scales, none here)
    logits_scaling: float = 1.0
    # The cache keeps each token's [c, k_r] once, as its key: the values are the keys' first C dims
    # (`models.values_are_keys`).
    values_are_keys: bool = True
    mtp_layers: int = 0  # V3's multi-token prediction layers, after `num_layers` in its checkpoints (`mtp.py`)

    @classmethod
    def from_hf(cls, hf: Any, attention: AttentionConfig | None = None) -> "DeepseekConfig":
        v3 = hf.model_type == "deepseek_v3"
        method = getattr(hf, "topk_method", None) or ("noaux_tc" if v3 else "greedy")
        if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"DeepSeek's topk_method {method!r} is not supported")
        if getattr(hf, "attention_bias", False):
            raise ValueError("DeepSeek with attention biases is not supported")
        grouped = method != "greedy" and (getattr(hf, "n_group", None) or 1) > 1
        moe = MoeConfig(
            hf.n_routed_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, bool(hf.norm_topk_prob),
            shared_expert_size=hf.moe_intermediate_size * (getattr(hf, "n_shared_experts", None) or 0),
            shared_expert_gated=False, scoring="sigmoid" if method == "noaux_tc" else "softmax",
            num_groups=hf.n_group if grouped else 1, top_groups=hf.topk_group if grouped else 1,
            score_correction=method == "noaux_tc", routed_scaling=float(hf.routed_scaling_factor or 1.0))
        rope_dims = hf.qk_rope_head_dim
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            q_lora_rank=hf.q_lora_rank,
            kv_lora_rank=hf.kv_lora_rank,
            qk_nope_head_dim=hf.qk_nope_head_dim,
            qk_rope_head_dim=rope_dims,
            v_head_dim=hf.v_head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            max_position_embeddings=hf.max_position_embeddings,
            rope=rope_for(hf, rope_dims),
            sm_scale=_softmax_scale(rope_parameters(hf), hf.qk_nope_head_dim + rope_dims),
            moe=moe,
            first_dense_layers=hf.first_k_dense_replace or 0,
            attention=attention or AttentionConfig(),
            mtp_layers=int(getattr(hf, "num_nextn_predict_layers", 0) or 0) if v3 else 0,
        )

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer, whether its MLP is the experts (after the first `first_k_dense_replace` dense ones)."""
        return tuple(layer >= self.first_dense_layers for layer in range(self.num_layers))

    @property
    def head_dim(self) -> int:
        """What the cache keeps a KV head: the latent and the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def with_heads(self, num_heads: int, num_kv_heads: int) -> "DeepseekConfig":
        """The same model with its heads laid out for tensor parallelism: the query heads split over the
        devices, the latent's one KV head copied to each."""
        return dataclasses.replace(self, num_heads=num_heads, num_kv_heads=num_kv_heads)

    def with_expert_parallel(self) -> "DeepseekConfig":
        """Experts split whole over the mesh's devices (`--enable-expert-parallel`), not by their F axis."""
        return dataclasses.replace(self, moe=dataclasses.replace(self.moe, expert_parallel=True))


def _softmax_scale(rope: dict[str, Any], qk_head_dim: int) -> float:
    """(P + R)^-1/2, times YaRN's mscale(factor, mscale_all_dim) squared where the config scales RoPE (the
    reference implementation's, and transformers' `yarn_apply_mscale`)."""
    scale = qk_head_dim ** -0.5
    if rope.get("rope_type", "default") != "default" and (all_dim := rope.get("mscale_all_dim")):
        factor = rope["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def _per_head(spec: str, x: jax.Array, w: jax.Array, attention: AttentionConfig) -> jax.Array:
    """x, in w's dtype, times w head by head (an einsum batched over the heads), in float32 sums. XLA:CPU has no
    batched dot of 16-bit operands into float32 (its DotThunk: "BF16 x BF16 = F32"); off CUDA a 16-bit einsum
    runs in the operands' dtype, which XLA:CPU sums in float32 and rounds once: the same values where x's dtype
    is the weights' (a float32 x with 16-bit weights takes its result rounded to their dtype)."""
    x = x.astype(w.dtype)
    if attention.cuda or w.dtype == jnp.float32:
        return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    return jnp.einsum(spec, x, w)


class LatentAttention(nnx.Module):
    def __init__(self, cfg: DeepseekConfig, dtype: Any, weight_dtype: Any) -> None:
        d, n, p, r, c, v = (cfg.hidden_size, cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                            cfg.kv_lora_rank, cfg.v_head_dim)
        if cfg.q_lora_rank is None:
            self.q_proj = param(d, n, p + r, dtype=weight_dtype)
        else:
            self.q_a_proj = param(d, cfg.q_lora_rank, dtype=weight_dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LATENT_NORM_EPS, dtype)
            self.q_b_proj = param(cfg.q_lora_rank, n, p + r, dtype=weight_dtype)
        self.kv_a_proj = param(d, c + r, dtype=weight_dtype)  # the latent and the RoPE key
        self.kv_a_layernorm = RMSNorm(c, _LATENT_NORM_EPS, dtype)
        self.w_uk = param(n, p, c, dtype=weight_dtype)  # the keys' up-projection, absorbed into the queries
        self.w_uv = param(n, v, c, dtype=weight_dtype)  # the values', applied to the attention's output
        self.o_proj = param(n, v, d, dtype=weight_dtype)
        self.cfg = cfg

    def __call__(self, x, positions, kv_cache, md: AttentionMetadata, lora_slots=None):
        cfg, attention = self.cfg, self.cfg.attention
        p, c = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank is None:
            q = project_heads(x, self.q_proj[...], attention)  # [T, N, P + R]
        else:
            q = project_heads(self.q_a_layernorm(dense(x, self.q_a_proj[...], attention)), self.q_b_proj[...],
                              attention)
        latent = dense(x, self.kv_a_proj[...], attention)  # [T, C + R]
        kv = self.kv_a_layernorm(latent[:, :c])  # [T, C]
        k_rope = apply_rope(latent[:, None, c:], positions, cfg.rope)  # [T, 1, R]
        q_rope = apply_rope(q[..., p:], positions, cfg.rope)  # [T, N, R]
        q_latent = _per_head("tnp,npc->tnc", q[..., :p], self.w_uk[...], attention).astype(q.dtype)  # [T, N, C]
        query = jnp.concatenate([q_latent, q_rope], axis=-1)  # [T, N, C + R]
        key = jnp.concatenate([kv[:, None, :], k_rope], axis=-1)  # [T, 1, C + R]: what the cache keeps
        if cfg.num_kv_heads > 1:  # a copy for each device's query heads (tensor parallelism)
            key = jnp.broadcast_to(key, (key.shape[0], cfg.num_kv_heads, key.shape[2]))
        out, kv_cache = paged_attention(query, key, None, kv_cache, md, attention=attention, sm_scale=cfg.sm_scale,
                                        value_dims=c)  # [T, N, C]: the values are the cached latents
        heads = _per_head("tnc,nvc->tnv", out, self.w_uv[...], attention).astype(x.dtype)  # [T, N, V]
        return merge_heads(heads, self.o_proj[...], attention), kv_cache


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: DeepseekConfig, dtype: Any, weight_dtype: Any, layer: int) -> None:
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps, dtype)
        self.self_attn = LatentAttention(cfg, dtype, weight_dtype)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype)
        self.is_moe = cfg.moe_layers[layer]
        self.mlp = (SparseMoeBlock(cfg.moe, d, cfg.attention, weight_dtype) if self.is_moe
                    else GatedMlp(d, cfg.intermediate_size, weight_dtype, cfg.attention, None, "silu"))

    def __call__(self, x, positions, kv_cache, md, lora_slots=None):
        attn_out, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, md)
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


class DeepseekForCausalLM(llama.LlamaForCausalLM):
    """Llama's stack (embeddings, layers, norm, LM head) of DeepSeek's blocks."""

    layer_class = DecoderLayer


LAYERS_KEY = llama.LAYERS_KEY
EMBEDDING_TABLES = llama.EMBEDDING_TABLES
EXPERT_WEIGHTS = llama.EXPERT_WEIGHTS  # the routed experts: kept in a GGUF file's blocks, or in FP8
# `--quantization fp8`: the projections `layers.dense` multiplies by (the queries', the latent's, the output, the
# dense and shared MLPs'), and the routed experts (`EXPERT_WEIGHTS`); the up-projections W_UK and W_UV (einsums
# over every head's latent) keep their dtype.
QUANTIZED_WEIGHTS = {"q_proj": 1, "q_a_proj": 1, "q_b_proj": 1, "kv_a_proj": 1, "o_proj": 2, "gate_proj": 1,
                     "up_proj": 1, "down_proj": 1}


# Tensor parallelism (`jaxserve.parallel`): the query heads and everything per head split, the latents'
# projections whole on every device (each computes the latent its cache copy keeps); the MLPs and experts as
# Llama's.
TENSOR_PARALLEL: dict[str, SplitRule] = {
    **llama.TENSOR_PARALLEL, "q_proj": (1, "q"), "q_b_proj": (1, "q"), "w_uk": (0, "q"), "w_uv": (0, "q"),
    "o_proj": (0, "q"), "q_a_proj": (None, None), "kv_a_proj": (None, None),
}


def split_rule(name: str, cfg: DeepseekConfig) -> SplitRule:
    """How the parameter `name` splits over a mesh (the experts as the config lays them out)."""
    if cfg.moe.expert_parallel and name in llama.EXPERT_PARALLEL:
        return llama.EXPERT_PARALLEL[name]
    return TENSOR_PARALLEL[name]


def kv_scale_factor(cfg: DeepseekConfig, path: tuple, k_scale: float, v_scale: float) -> Any:
    """What a layer's parameter at `path` is multiplied by to fold an FP8 cache's scale into the weights
    (`kv_scales.py`). The cache keeps one array, its values its keys, so one scale s = `k_scale` serves it
    (`v_scale` is not used): the latent c / s (the norm's scale divided; the latent's projection feeds the norm,
    which undoes any scale of it) and the RoPE key k_r / s (its projection's RoPE columns); the queries' latent
    part (W_UK) and RoPE part (their projection's RoPE columns) times s, so each score is unchanged; and W_UV
    times s, so each head's output is."""
    c, p, r = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    rope_key = np.concatenate([np.ones(c), np.full(r, 1.0 / k_scale)]).astype(np.float32)  # over [C + R]
    rope_query = np.concatenate([np.ones(p), np.full(r, k_scale)]).astype(np.float32)  # over a head's [P + R]
    return {("self_attn", "kv_a_layernorm", "scale"): 1.0 / k_scale, ("self_attn", "kv_a_proj"): rope_key,
            ("self_attn", "q_proj"): rope_query, ("self_attn", "q_b_proj"): rope_query,
            ("self_attn", "w_uk"): k_scale, ("self_attn", "w_uv"): k_scale}.get(path)


def _rope_rows_last(width: int, rope_dims: int) -> np.ndarray:
    """i64[width]: the order of a row block whose last `rope_dims` rows are RoPE's, interleaved to rotate-half."""
    head = width - rope_dims
    return np.concatenate([np.arange(head), head + rotate_half_order(rope_dims, rope_dims)])


def _query_heads(w: np.ndarray, cfg: DeepseekConfig) -> np.ndarray:
    """A query projection [N * (P + R), in] as [in, N, P + R]."""
    return np.ascontiguousarray(np.asarray(w).T.reshape(-1, cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim))


def _rope_rows(name: str, cfg: DeepseekConfig) -> np.ndarray | None:
    """i64[out]: the order that puts the RoPE rows of the projection `name` (the queries', each head's last R
    rows; the latent's, its last R) in the rotate-half layout, or None for a tensor without RoPE rows."""
    r = cfg.qk_rope_head_dim
    if name.endswith((".self_attn.q_proj.weight", ".self_attn.q_b_proj.weight")):
        width = cfg.qk_nope_head_dim + r
        return (np.arange(cfg.num_heads)[:, None] * width + _rope_rows_last(width, r)).reshape(-1)
    if name.endswith(".self_attn.kv_a_proj_with_mqa.weight"):
        return _rope_rows_last(cfg.kv_lora_rank + r, r)
    return None


def _up_projections(name: str, tensor: Any, cfg: DeepseekConfig) -> list[tuple[str, np.ndarray]]:
    """The keys' and the values' up-projections as [N, P, C] and [N, V, C], from `kv_b_proj` [N * (P + V), C],
    or from llama.cpp's split of it: `k_b_proj` [N, C, P] (transposed) and `v_b_proj` [N, V, C]."""
    n, p, c, v = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    stem, _, kind = name.removesuffix(".weight").rpartition(".")
    stem += "."
    if kind == "k_b_proj":
        return [(stem + "w_uk", np.asarray(tensor).reshape(n, c, p).transpose(0, 2, 1))]
    if kind == "v_b_proj":
        return [(stem + "w_uv", np.asarray(tensor).reshape(n, v, c))]
    heads = np.asarray(tensor).reshape(n, p + v, c)
    return [(stem + "w_uk", heads[:, :p]), (stem + "w_uv", heads[:, p:])]


def hf_weight_stream(tensors: Iterator[tuple[str, Any]], cfg: DeepseekConfig) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors as the model keeps them: the experts stacked per layer and kind, `kv_b_proj`
    split into the keys' and values' up-projections, and the RoPE rows of the queries' and the latent's
    projections reordered to the rotate-half layout (rows move whole, so a GGUF file's blocks and an FP8
    checkpoint's per-row scales move with them)."""
    experts = ExpertStacker(cfg.moe.num_experts)
    for name, tensor in tensors:
        if (stacked := experts.add(name, tensor)) is not None:
            yield from stacked
        elif name.endswith((".self_attn.kv_b_proj.weight", ".self_attn.k_b_proj.weight",
                            ".self_attn.v_b_proj.weight")):
            yield from _up_projections(name, tensor, cfg)
        elif (order := _rope_rows(name, cfg)) is not None:
            yield name, tensor[order]
        else:
            yield name, tensor
    experts.check_complete()


# HF checkpoint name (after `hf_weight_stream`) -> (NNX path, transform). HF Linear weights are [out, in].
_LAYER_MAP: dict[str, tuple[tuple[str, ...], Callable[[np.ndarray, DeepseekConfig], np.ndarray]]] = {
    **{name: llama._LAYER_MAP[name] for name in (
        "input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "mlp.gate.weight", "mlp.experts_gate", "mlp.experts_up", "mlp.experts_down",
        "mlp.gate.e_score_correction_bias",
        *(f"mlp.shared_experts.{kind}_proj.weight" for kind in ("gate", "up", "down")))},
    "self_attn.q_proj.weight": (("self_attn", "q_proj"), _query_heads),
    "self_attn.q_a_proj.weight": (("self_attn", "q_a_proj"), lambda w, c: w.T),
    "self_attn.q_a_layernorm.weight": (("self_attn", "q_a_layernorm", "scale"), lambda w, c: w),
    "self_attn.q_b_proj.weight": (("self_attn", "q_b_proj"), _query_heads),
    "self_attn.kv_a_proj_with_mqa.weight": (("self_attn", "kv_a_proj"), lambda w, c: w.T),
    "self_attn.kv_a_layernorm.weight": (("self_attn", "kv_a_layernorm", "scale"), lambda w, c: w),
    "self_attn.w_uk": (("self_attn", "w_uk"), lambda w, c: w),
    "self_attn.w_uv": (("self_attn", "w_uv"), lambda w, c: w),
    "self_attn.o_proj.weight": (
        ("self_attn", "o_proj"), lambda w, c: w.T.reshape(c.num_heads, c.v_head_dim, c.hidden_size)),
}
_LAYER_RE = llama._LAYER_RE


def map_hf_weight(name: str, cfg: DeepseekConfig) -> tuple[tuple[str | int, ...], Callable] | None:
    """Where an HF tensor goes in this model, or None for tensors the model has no use for (V3's multi-token
    prediction layers past `num_hidden_layers`, among them: `mtp.py` loads them as a drafter)."""
    if match := _LAYER_RE.match(name):
        layer = int(match.group(1))
        entry = _LAYER_MAP.get(match.group(2))
        if entry is None or layer >= cfg.num_layers:
            return None
        path, transform = entry
        return ("layers", layer, *path), transform
    return llama.map_outer_weight(name, cfg)
