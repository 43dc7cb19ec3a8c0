"""Gemma, Gemma 2 and Gemma 3 (text) in Flax NNX.

What sets them apart from the Llama family: RMSNorms that scale by (1 + w), a norm before and after both
the attention and the MLP (Gemma: before only), a GeGLU MLP (tanh-approximated GELU), token embeddings
scaled by sqrt(D), queries scaled by `query_pre_attn_scalar`^-1/2 (Gemma: H^-1/2), and local layers with a
sliding window beside global ones. Gemma 2 soft-caps attention scores and final logits; Gemma 3
normalises each query and key head (like Qwen3) and gives its local layers their own RoPE base.

The norms' (1 + w) is formed once on load, in float32 (the norms' parameters are float32 whatever the
model's dtype), so a norm multiplies as transformers' does and the shared `RMSNorm` serves.

Axis letters: T tokens, D hidden, N query heads, K kv heads, H head dim, F MLP width, V vocab.
"""

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models import llama
from jaxserve.models.classifier import ClassifierHead
from jaxserve.models.layers import (
    AttentionLora,
    AttentionMetadata,
    GatedMlp,
    KVCache,
    LoraShape,
    RMSNorm,
    Rope,
    apply_layers,
    apply_rope,
    embedding_lookup,
    layer_windows,
    logits_from_embeddings,
    merge_heads,
    paged_attention,
    param,
    project_heads,
    rope_for,
)
from jaxserve.ops.attention import AttentionConfig

NORM_DTYPE = jnp.float32  # the norms hold (1 + w) in float32 (module docstring)


@dataclass(frozen=True)
class GemmaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    sm_scale: float  # query_pre_attn_scalar ** -0.5
    ropes: tuple[Rope, ...]  # per layer (Gemma 3's local layers have their own base)
    sliding_windows: tuple[int | None, ...]  # per layer; None: a global layer
    attn_logit_softcap: float | None = None  # Gemma 2
    final_logit_softcap: float | None = None  # Gemma 2
    qk_norm: bool = False  # Gemma 3
    norms_after: bool = True  # Gemma 2 and 3: each block's output normed too (Gemma: only its input)
    tie_word_embeddings: bool = True
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    lora: LoraShape | None = None  # --enable-lora: each dense projection's adapters (`LoraStack`)
    classifier: ClassifierHead | None = None  # a sequence classifier's head (`classifier.py`), set by the loader

    @classmethod
    def from_hf(cls, hf: Any, attention: AttentionConfig | None = None) -> "GemmaConfig":
        if getattr(hf, "attention_bias", False):
            raise ValueError("Gemma with attention biases is not supported")
        head_dim = hf.head_dim
        layer_types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=hf.num_key_value_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            sm_scale=getattr(hf, "query_pre_attn_scalar", head_dim) ** -0.5,
            ropes=tuple(rope_for(hf, head_dim, kind) for kind in layer_types),
            sliding_windows=layer_windows(hf),
            attn_logit_softcap=getattr(hf, "attn_logit_softcapping", None),
            final_logit_softcap=getattr(hf, "final_logit_softcapping", None),
            qk_norm=hf.model_type.startswith("gemma3"),
            norms_after=hf.model_type != "gemma",
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
            attention=attention or AttentionConfig(),
        )

    def window(self, layer: int) -> int | None:
        return self.sliding_windows[layer]

    def with_heads(self, num_heads: int, num_kv_heads: int) -> "GemmaConfig":
        """The same model with its heads laid out for tensor parallelism (`jaxserve.parallel.HeadLayout`)."""
        return dataclasses.replace(self, num_heads=num_heads, num_kv_heads=num_kv_heads)


class Attention(nnx.Module):
    def __init__(self, cfg: GemmaConfig, weight_dtype: Any, layer: int) -> None:
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = param(d, n, h, dtype=weight_dtype)
        self.k_proj = param(d, k, h, dtype=weight_dtype)
        self.v_proj = param(d, k, h, dtype=weight_dtype)
        self.o_proj = param(n, h, d, dtype=weight_dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, cfg.rms_norm_eps, NORM_DTYPE)
            self.k_norm = RMSNorm(h, cfg.rms_norm_eps, NORM_DTYPE)
        if cfg.lora is not None:
            self.lora = AttentionLora(d, n, k, h, cfg.lora, weight_dtype, cfg.attention)
        self.cfg = cfg
        self.rope = cfg.ropes[layer]
        self.sliding_window = cfg.window(layer)

    def __call__(self, x, positions, kv_cache, md: AttentionMetadata, lora_slots=None):
        attention = self.cfg.attention
        q = project_heads(x, self.q_proj[...], attention)  # [T, N, H]
        k = project_heads(x, self.k_proj[...], attention)  # [T, K, H]
        v = project_heads(x, self.v_proj[...], attention)
        if lora_slots is not None:
            q, k, v = self.lora.add_qkv(x, lora_slots, q, k, v)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # over H, per token and head
        q, k = apply_rope(q, positions, self.rope), apply_rope(k, positions, self.rope)
        out, kv_cache = paged_attention(
            q, k, v, kv_cache, md, attention=attention, sm_scale=self.cfg.sm_scale,
            sliding_window=self.sliding_window, logit_softcap=self.cfg.attn_logit_softcap,
        )
        y = merge_heads(out, self.o_proj[...], attention)  # [T, D]
        return (y if lora_slots is None else self.lora.add_o(y, out, lora_slots)), kv_cache


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: GemmaConfig, weight_dtype: Any, layer: int) -> None:
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps, NORM_DTYPE)
        self.self_attn = Attention(cfg, weight_dtype, layer)
        self.pre_feedforward_layernorm = RMSNorm(d, eps, NORM_DTYPE)
        self.mlp = GatedMlp(d, cfg.intermediate_size, weight_dtype, cfg.attention, cfg.lora, "gelu_tanh")  # GeGLU
        if cfg.norms_after:
            self.post_attention_layernorm = RMSNorm(d, eps, NORM_DTYPE)
            self.post_feedforward_layernorm = RMSNorm(d, eps, NORM_DTYPE)
        self.norms_after = cfg.norms_after

    def __call__(self, x, positions, kv_cache, md, lora_slots=None):
        attn_out, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, md, lora_slots)
        x = x + (self.post_attention_layernorm(attn_out) if self.norms_after else attn_out)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(x), lora_slots)
        return x + (self.post_feedforward_layernorm(mlp_out) if self.norms_after else mlp_out), kv_cache


class GemmaForCausalLM(nnx.Module):
    def __init__(self, cfg: GemmaConfig, dtype: Any, weight_dtype: Any = None) -> None:
        """`dtype`: activations; `weight_dtype` (None: `dtype`): projections, embeddings, LM head. Norms: float32."""
        weight_dtype = weight_dtype or dtype
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = param(cfg.vocab_size, cfg.hidden_size, dtype=weight_dtype)
        self.layers = nnx.List([DecoderLayer(cfg, weight_dtype, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, NORM_DTYPE)
        if not cfg.tie_word_embeddings:
            self.lm_head = param(cfg.vocab_size, cfg.hidden_size, dtype=weight_dtype)

    def __call__(
        self,
        input_ids: jax.Array,  # i32[T]
        positions: jax.Array,  # i32[T]
        kv_caches: KVCache,
        md: AttentionMetadata,
        lora_slots: jax.Array | None = None,  # i32[T]: each token's adapter slot, with --enable-lora
    ) -> tuple[jax.Array, KVCache]:  # [T, D]
        x = embedding_lookup(self.embed_tokens[...], input_ids, self.cfg.attention.mesh).astype(self.dtype)
        x = x * jnp.asarray(math.sqrt(self.cfg.hidden_size), self.dtype)  # rounded to the dtype, as in HF
        lora_slots = lora_slots if self.cfg.lora is not None else None
        x, new_caches = apply_layers(self.layers, x, kv_caches, positions=positions, md=md, lora_slots=lora_slots)
        return self.norm(x), new_caches

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [R, D] -> f32[R, V]
        head = self.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head
        logits = logits_from_embeddings(hidden, head[...], self.cfg.attention)
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)


LAYERS_KEY = llama.LAYERS_KEY
QUANTIZED_WEIGHTS = llama.QUANTIZED_WEIGHTS  # the same names and layouts
EMBEDDING_TABLES = llama.EMBEDDING_TABLES
kv_scale_factor = llama.kv_scale_factor  # the same folding: Gemma 3's per-head norms as Qwen3's
TENSOR_PARALLEL = llama.TENSOR_PARALLEL  # the same parameter names
LORA_TARGETS, LORA_FUSED_TARGETS = llama.LORA_TARGETS, llama.LORA_FUSED_TARGETS  # the same stacks


def _plus_one(w: np.ndarray, cfg: GemmaConfig) -> np.ndarray:
    return np.asarray(w, np.float32) + 1.0


# HF checkpoint name -> (NNX path, transform): the projections as Llama's, the norms as 1 + w.
_PROJECTIONS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_LAYER_MAP: dict[str, tuple[tuple[str, ...], Callable[[np.ndarray, GemmaConfig], np.ndarray]]] = {
    **{name: llama._LAYER_MAP[name] for name in _PROJECTIONS},
    **{f"{norm}.weight": ((norm, "scale"), _plus_one) for norm in (
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")},
    "self_attn.q_norm.weight": (("self_attn", "q_norm", "scale"), _plus_one),
    "self_attn.k_norm.weight": (("self_attn", "k_norm", "scale"), _plus_one),
}
_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")


def map_hf_weight(name: str, cfg: GemmaConfig) -> tuple[tuple[str | int, ...], Callable] | None:
    """Where an HF tensor goes in this model, or None for tensors the model has no use for. Gemma's
    `post_attention_layernorm` is the norm before its MLP (Gemma 2's `pre_feedforward_layernorm`)."""
    if match := _LAYER_RE.match(name):
        layer_name = match.group(2)
        if not cfg.norms_after and layer_name == "post_attention_layernorm.weight":
            layer_name = "pre_feedforward_layernorm.weight"
        entry = _LAYER_MAP.get(layer_name)
        if entry is None:
            return None
        path, transform = entry
        return ("layers", int(match.group(1)), *path), transform
    if name in ("model.embed_tokens.weight", "embed_tokens.weight"):
        return ("embed_tokens",), lambda w, c: w
    if name in ("model.norm.weight", "norm.weight"):
        return ("norm", "scale"), _plus_one
    if name == "lm_head.weight" and not cfg.tie_word_embeddings:
        return ("lm_head",), lambda w, c: w
    return None
