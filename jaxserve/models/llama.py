"""The Llama family in Flax NNX: Llama 2/3, SmolLM2, Mistral (a sliding window), Qwen2 (q/k/v biases; sliding
windows from `max_window_layers`), Qwen3 (an RMSNorm over each query and key head, before RoPE), Phi-3
(fused qkv and gate/up projections, split on load; LongRoPE and partial rotary), GLM-4 (RoPE on adjacent pairs
over half of each head, norms before and after each block), GLM-4.5 (partial rotary, q/k/v biases; after its
first dense layers, DeepSeek-V3's experts: sigmoid scores, a correction bias for the choice, an ungated shared
expert; its multi-token prediction layers past `num_hidden_layers` are not loaded), Granite (the embeddings,
each block's output, the attention scores and the logits scaled by the config's multipliers), SmolLM3 (no
RoPE in every fourth layer), OLMo 2 (each block's output normed instead of its input; one RMSNorm over all
query heads and one over all key heads), OLMo 3 (OLMo 2 with three windowed layers to a full one, YaRN on the
full ones only); Mixtral, Qwen3-MoE and Qwen2-MoE (a mixture-of-experts MLP,
`moe.py`, in every layer or in those the config names; Qwen2-MoE's with a gated shared expert beside it);
GPT-OSS (attention sinks, biases everywhere, sliding layers between full ones, YaRN, experts with biases and
a clamped SwiGLU, routed by a softmax over the top k logits; its experts fused, or in MXFP4, split on load).

Axis letters: T tokens, D hidden, N query heads, K kv heads, H head dim, F MLP width, V vocab.
"""

import dataclasses
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models import layers
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
from jaxserve.models.moe import ExpertStacker, MoeConfig, SparseMoeBlock, expert_split_axes
from jaxserve.models.mxfp4 import decode_mxfp4
from jaxserve.models.quantization import Fp8Tensor
from jaxserve.models.rope_layout import rotate_half_order, to_rotate_half
from jaxserve.ops.attention import AttentionConfig
from jaxserve.parallel import SplitRule


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    rope: Rope  # every layer's, unless `layer_ropes` says otherwise
    qk_norm: str | None = None  # "head": an RMSNorm over each head's query and key (Qwen3), weights [H];
    # "all": one over all heads' queries and one over all keys (OLMo 2), weights [N*H] and [K*H]
    o_bias: bool = False  # a bias on the output projection (Llama, Granite and GPT-OSS with `attention_bias`)
    clip_qkv: float | None = None  # OLMoE's `clip_qkv`: queries, keys and values clamped to +-it after the norms
    attention_sinks: bool = False  # GPT-OSS: a learned logit per query head in each softmax's denominator
    norm_after: bool = False  # OLMo 2: each block's output normed before the residual add, not its input
    sandwich_norms: bool = False  # GLM-4: each block's input and output normed (`post_self_attn_layernorm`...)
    interleaved_rope: bool = False  # GLM-4: RoPE on adjacent pairs; q and k rows reordered at load (`rope_layout`)
    rope_layers: tuple[bool, ...] = ()  # per layer, whether RoPE applies (SmolLM3's NoPE layers); empty: all
    layer_ropes: tuple[Rope, ...] = ()  # per layer, where the config lists layer kinds (RoPE may differ by kind:
    # OLMo 3's YaRN on its full layers only); empty: `rope` everywhere
    # Granite: the embeddings and each block's output multiplied, the attention's scale (None: 1 / sqrt(H)),
    # and the logits divided by `logits_scaling`.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    sliding_windows: tuple[int | None, ...] = ()  # per layer (None: full attention); empty: none anywhere
    moe: MoeConfig | None = None  # Mixtral, Qwen3-MoE
    moe_layers: tuple[bool, ...] = ()  # per layer: a mixture of experts (True) or the dense MLP
    attention: AttentionConfig = field(default_factory=AttentionConfig)  # resolved for the compile device
    lora: LoraShape | None = None  # --enable-lora: each dense projection's adapters (`LoraStack`)
    mtp_layers: int = 0  # GLM-4.5's multi-token prediction layers, after `num_layers` in its checkpoints: not
    # loaded with the model (`mtp.py` loads them as a drafter)
    classifier: ClassifierHead | None = None  # a sequence classifier's head (`classifier.py`), set by the loader

    @classmethod
    def from_hf(cls, hf: Any, attention: AttentionConfig | None = None) -> "LlamaConfig":
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        attention_bias = bool(getattr(hf, "attention_bias", False))
        qkv_bias = (attention_bias or hf.model_type == "qwen2"
                    or (hf.model_type == "qwen2_moe" and bool(getattr(hf, "qkv_bias", True))))
        windows = layer_windows(hf)
        moe, moe_layers = _moe_of(hf)
        granite = hf.model_type in ("granite", "granitemoe", "granitemoeshared")
        no_rope_layers = getattr(hf, "no_rope_layers", None) if hf.model_type == "smollm3" else None
        layer_types = getattr(hf, "layer_types", None) or ()
        olmo = hf.model_type in ("olmo2", "olmo3")
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            max_position_embeddings=hf.max_position_embeddings,
            rope=rope_for(hf, head_dim, "full_attention"),
            qk_norm="all" if olmo or hf.model_type == "olmoe" else {"qwen3": "head", "qwen3_moe": "head"}.get(
                hf.model_type, "head" if getattr(hf, "use_qk_norm", False) else None),  # GLM-4.5's option
            o_bias=attention_bias and hf.model_type not in ("qwen2", "qwen2_moe", "glm4", "glm4_moe"),  # q, k, v
            clip_qkv=getattr(hf, "clip_qkv", None) if hf.model_type == "olmoe" else None,
            attention_sinks=hf.model_type == "gpt_oss",
            norm_after=olmo,
            sandwich_norms=hf.model_type == "glm4",
            interleaved_rope=hf.model_type == "glm4",
            rope_layers=tuple(bool(use) for use in no_rope_layers) if no_rope_layers else (),
            layer_ropes=tuple(rope_for(hf, head_dim, kind) for kind in layer_types),
            embedding_multiplier=hf.embedding_multiplier if granite else 1.0,
            residual_multiplier=hf.residual_multiplier if granite else 1.0,
            attention_multiplier=hf.attention_multiplier if granite else None,
            logits_scaling=hf.logits_scaling if granite else 1.0,
            sliding_windows=windows if any(windows) else (),
            moe=moe,
            moe_layers=moe_layers,
            attention=attention or AttentionConfig(),
            mtp_layers=int(getattr(hf, "num_nextn_predict_layers", 0) or 0) if hf.model_type == "glm4_moe" else 0,
        )

    def is_mtp_tensor(self, name: str) -> bool:
        """Whether a checkpoint tensor belongs to a multi-token prediction layer (not loaded with the model; a
        drafter of their own, `mtp.py`)."""
        match = _LAYER_RE.match(name) if self.mtp_layers else None
        return match is not None and self.num_layers <= int(match.group(1)) < self.num_layers + self.mtp_layers

    @property
    def rotary_dim(self) -> int:
        """The rotary dims of each head (the first ones; partial rotary leaves the rest)."""
        return 2 * len(self.rope.inv_freq)

    def window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    def uses_rope(self, layer: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer]

    def rope_of(self, layer: int) -> Rope | None:
        """Layer `layer`'s rotary embedding; None where it has none."""
        if not self.uses_rope(layer):
            return None
        return self.layer_ropes[layer] if self.layer_ropes else self.rope

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    def with_expert_parallel(self) -> "LlamaConfig":
        """Experts split whole over the mesh's devices (`--enable-expert-parallel`), not by their F axis."""
        if self.moe is None:
            raise ValueError("--enable-expert-parallel: the model has no experts")
        return dataclasses.replace(self, moe=dataclasses.replace(self.moe, expert_parallel=True))

    def with_heads(self, num_heads: int, num_kv_heads: int) -> "LlamaConfig":
        """The same model with its heads laid out for tensor parallelism (`jaxserve.parallel.HeadLayout`)."""
        if self.qk_norm == "all" and (num_heads, num_kv_heads) != (self.num_heads, self.num_kv_heads):
            raise ValueError(f"tensor parallelism: the query and key norms over all heads need {self.num_heads} "
                             f"query and {self.num_kv_heads} KV heads to split evenly over the devices")
        return dataclasses.replace(self, num_heads=num_heads, num_kv_heads=num_kv_heads)


def _moe_of(hf: Any) -> tuple[MoeConfig | None, tuple[bool, ...]]:
    """The experts of a Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE, Granite-MoE, GPT-OSS or GLM-4.5 config, and which
    layers have them."""
    num_layers = hf.num_hidden_layers
    if hf.model_type == "glm4_moe":  # DeepSeek-V3's router (`moe.route_deepseek`), after the first dense layers
        grouped = (getattr(hf, "n_group", None) or 1) > 1
        first_sparse = getattr(hf, "first_k_dense_replace", None) or 0
        return (MoeConfig(hf.n_routed_experts, hf.num_experts_per_tok, hf.moe_intermediate_size,
                          bool(hf.norm_topk_prob),
                          shared_expert_size=hf.moe_intermediate_size * (getattr(hf, "n_shared_experts", None) or 0),
                          shared_expert_gated=False, scoring="sigmoid", num_groups=hf.n_group if grouped else 1,
                          top_groups=hf.topk_group if grouped else 1, score_correction=True,
                          routed_scaling=float(hf.routed_scaling_factor or 1.0)),
                tuple(layer >= first_sparse for layer in range(num_layers)))
    if hf.model_type == "olmoe":
        return (MoeConfig(hf.num_experts, hf.num_experts_per_tok, hf.intermediate_size, bool(hf.norm_topk_prob)),
                (True,) * num_layers)
    if hf.model_type in ("granitemoe", "granitemoeshared"):  # the top k logits, then their softmax
        shared = getattr(hf, "shared_intermediate_size", 0) if hf.model_type == "granitemoeshared" else 0
        return (MoeConfig(hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size, False,
                          softmax_after_top_k=True, shared_expert_size=shared, shared_expert_gated=False),
                (True,) * num_layers)
    if hf.model_type == "mixtral":
        return MoeConfig(hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size, True), (True,) * num_layers
    if hf.model_type == "gpt_oss":
        return MoeConfig(hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size, False,
                         softmax_after_top_k=True, biases=True, swiglu_limit=float(hf.swiglu_limit),
                         swiglu_alpha=float(hf.swiglu_alpha)), (True,) * num_layers
    if hf.model_type in ("qwen3_moe", "qwen2_moe") and hf.num_experts:
        dense = set(getattr(hf, "mlp_only_layers", None) or ())
        step = getattr(hf, "decoder_sparse_step", 1) or 1
        layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
        shared = getattr(hf, "shared_expert_intermediate_size", 0) if hf.model_type == "qwen2_moe" else 0
        return MoeConfig(hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size,
                         bool(hf.norm_topk_prob), shared_expert_size=shared), layers
    return None, ()


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dtype: Any, weight_dtype: Any, layer: int, input_size: int | None = None
                 ) -> None:
        """`input_size`: the queries', keys' and values' input width where it is not the hidden size (an EAGLE-3
        drafter's [embedding ; feature])."""
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = param(input_size or d, n, h, dtype=weight_dtype)
        self.k_proj = param(input_size or d, k, h, dtype=weight_dtype)
        self.v_proj = param(input_size or d, k, h, dtype=weight_dtype)
        self.o_proj = param(n, h, d, dtype=weight_dtype)
        if cfg.qkv_bias:
            self.q_bias = param(n, h, dtype=dtype)
            self.k_bias = param(k, h, dtype=dtype)
            self.v_bias = param(k, h, dtype=dtype)
        if cfg.o_bias:
            self.o_bias = param(d, dtype=dtype)
        if cfg.attention_sinks:
            self.sinks = param(n, dtype=jnp.float32)
        if cfg.qk_norm:
            across = cfg.qk_norm == "all"
            self.q_norm = RMSNorm(n * h if across else h, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(k * h if across else h, cfg.rms_norm_eps, dtype)
        if cfg.lora is not None:
            self.lora = AttentionLora(d, n, k, h, cfg.lora, weight_dtype, cfg.attention)
        self.cfg = cfg
        self.sliding_window = cfg.window(layer)
        self.rope = cfg.rope_of(layer)

    def __call__(self, x, positions, kv_cache, md: AttentionMetadata, lora_slots=None):
        attention = self.cfg.attention
        q = project_heads(x, self.q_proj[...], attention)  # [T, N, H]
        k = project_heads(x, self.k_proj[...], attention)  # [T, K, H]
        v = project_heads(x, self.v_proj[...], attention)
        if lora_slots is not None:
            q, k, v = self.lora.add_qkv(x, lora_slots, q, k, v)
        if self.cfg.qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.cfg.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)  # over H, per token and head
        elif self.cfg.qk_norm == "all":  # over N*H (K*H), per token
            q = self.q_norm(q.reshape(q.shape[0], -1)).reshape(q.shape)
            k = self.k_norm(k.reshape(k.shape[0], -1)).reshape(k.shape)
        if self.cfg.clip_qkv is not None:
            clip = self.cfg.clip_qkv
            q, k, v = jnp.clip(q, -clip, clip), jnp.clip(k, -clip, clip), jnp.clip(v, -clip, clip)
        if self.rope is not None:
            q, k = apply_rope(q, positions, self.rope), apply_rope(k, positions, self.rope)
        out, kv_cache = paged_attention(q, k, v, kv_cache, md, attention=attention,
                                        sm_scale=self.cfg.attention_multiplier, sliding_window=self.sliding_window,
                                        sinks=self.sinks[...] if self.cfg.attention_sinks else None)
        y = merge_heads(out, self.o_proj[...], attention)  # [T, D]
        if self.cfg.o_bias:
            y = y + self.o_bias[...]
        return (y if lora_slots is None else self.lora.add_o(y, out, lora_slots)), kv_cache


class DecoderLayer(nnx.Module):
    """x + attention(norm(x)), then the same with the MLP; with `norm_after` (OLMo 2), x + norm(attention(x))
    (HF names that norm `post_attention_layernorm` too, and the MLP's `post_feedforward_layernorm`); with
    `sandwich_norms` (GLM-4), x + norm(attention(norm(x)))."""

    def __init__(self, cfg: LlamaConfig, dtype: Any, weight_dtype: Any, layer: int) -> None:
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        if not cfg.norm_after:
            self.input_layernorm = RMSNorm(d, eps, dtype)
        self.self_attn = Attention(cfg, dtype, weight_dtype, layer)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype)
        if cfg.norm_after:
            self.post_feedforward_layernorm = RMSNorm(d, eps, dtype)
        if cfg.sandwich_norms:
            self.post_self_attn_layernorm = RMSNorm(d, eps, dtype)
            self.post_mlp_layernorm = RMSNorm(d, eps, dtype)
        self.is_moe = cfg.is_moe_layer(layer)
        self.mlp = (SparseMoeBlock(cfg.moe, d, cfg.attention, weight_dtype) if self.is_moe
                    else GatedMlp(d, cfg.intermediate_size, weight_dtype, cfg.attention, cfg.lora, "silu"))
        self.norm_after, self.sandwich_norms = cfg.norm_after, cfg.sandwich_norms
        self.residual_multiplier = cfg.residual_multiplier

    def _residual(self, x: jax.Array, out: jax.Array) -> jax.Array:
        return x + (out if self.residual_multiplier == 1.0 else out * self.residual_multiplier)

    def __call__(self, x, positions, kv_cache, md, lora_slots=None):
        h = x if self.norm_after else self.input_layernorm(x)
        attn_out, kv_cache = self.self_attn(h, positions, kv_cache, md, lora_slots)
        if self.norm_after:
            attn_out = self.post_attention_layernorm(attn_out)
        elif self.sandwich_norms:
            attn_out = self.post_self_attn_layernorm(attn_out)
        x = self._residual(x, attn_out)
        h = x if self.norm_after else self.post_attention_layernorm(x)
        mlp_out = self.mlp(h) if self.is_moe else self.mlp(h, lora_slots)
        if self.norm_after:
            mlp_out = self.post_feedforward_layernorm(mlp_out)
        elif self.sandwich_norms:
            mlp_out = self.post_mlp_layernorm(mlp_out)
        return self._residual(x, mlp_out), kv_cache


class LlamaForCausalLM(nnx.Module):
    layer_class: type[nnx.Module] = DecoderLayer  # a family of another block over the same stack (DeepSeek's)

    def __init__(self, cfg: LlamaConfig, dtype: Any, weight_dtype: Any = None) -> None:
        """`dtype`: activations, norms, biases; `weight_dtype` (None: `dtype`): projections, embeddings, LM head."""
        weight_dtype = weight_dtype or dtype
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = param(cfg.vocab_size, cfg.hidden_size, dtype=weight_dtype)
        self.layers = nnx.List([self.layer_class(cfg, dtype, weight_dtype, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
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
        hidden, new_caches, _ = self.hidden_and_layer_inputs(input_ids, positions, kv_caches, md, (), lora_slots)
        return hidden, new_caches

    def hidden_and_layer_inputs(
        self,
        input_ids: jax.Array,  # i32[T]
        positions: jax.Array,  # i32[T]
        kv_caches: KVCache,
        md: AttentionMetadata,
        layer_ids: tuple[int, ...],  # ascending
        lora_slots: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache, jax.Array | None]:
        """(final hidden [T, D], the KV caches, the residual stream entering each layer of `layer_ids`, [T,
        len(layer_ids) * D] side by side, or None where there are none): an EAGLE-3 drafter's features."""
        x = embedding_lookup(self.embed_tokens[...], input_ids, self.cfg.attention.mesh).astype(self.dtype)
        if self.cfg.embedding_multiplier != 1.0:
            x = x * self.cfg.embedding_multiplier
        lora_slots = lora_slots if self.cfg.lora is not None else None
        kwargs = dict(positions=positions, md=md, lora_slots=lora_slots)
        inputs, new_caches, start = [], [], 0
        for end in (*layer_ids, len(self.layers)):
            x, caches = apply_layers(self.layers[start:end], x, kv_caches[start:end], **kwargs)
            new_caches += caches
            inputs.append(x)
            start = end
        return self.norm(x), new_caches, jnp.concatenate(inputs[:-1], axis=-1) if layer_ids else None

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [R, D] -> f32[R, V]
        head = self.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head
        logits = logits_from_embeddings(hidden, head[...], self.cfg.attention)
        return logits if self.cfg.logits_scaling == 1.0 else logits / self.cfg.logits_scaling


LAYERS_KEY = "layers"  # the decoder layers' list in the model's state (`kv_scales.fold_kv_scales`)
# `--quantization fp8`: the layers' dense weights, each with its number of contracted axes (`quantization.py`).
QUANTIZED_WEIGHTS = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1, "up_proj": 1, "down_proj": 1}
# A mixture's stacked experts [E, in, out], which a GGUF file's blocks stay in (`gguf_weights.GgufExperts`) and
# `--quantization fp8` (or an FP8 checkpoint) keeps in e4m3 (`quantization.Fp8Experts`).
EXPERT_WEIGHTS = ("experts_gate", "experts_up", "experts_down")
# Token-embedding tables ([V, D], as a GGUF file stores them) that `--quantization gguf` keeps in their blocks.
EMBEDDING_TABLES = ("embed_tokens", "lm_head")


def kv_scale_factor(cfg: LlamaConfig, path: tuple, k_scale: float, v_scale: float) -> float | None:
    """What a layer's parameter at `path` is multiplied by to fold an FP8 cache's scales into the weights
    (`kv_scales.py`): K and V written divided by their scales, q.k and the attention output unchanged.
    With Qwen3's per-head norms, which undo any scale of the projections, q and k take theirs there."""
    q_and_k = ({("self_attn", "q_norm", "scale"): k_scale, ("self_attn", "k_norm", "scale"): 1.0 / k_scale}
               if cfg.qk_norm else
               {("self_attn", "q_proj"): k_scale, ("self_attn", "q_bias"): k_scale,
                ("self_attn", "k_proj"): 1.0 / k_scale, ("self_attn", "k_bias"): 1.0 / k_scale})
    return {**q_and_k, ("self_attn", "v_proj"): 1.0 / v_scale, ("self_attn", "v_bias"): 1.0 / v_scale,
            ("self_attn", "o_proj"): v_scale}.get(path)


# HF checkpoint name -> (NNX path, transform). HF Linear weights are [out, in].
def _proj_in(shape_fn: Callable[[LlamaConfig], tuple[int, ...]]):
    return lambda w, cfg: w.T.reshape(shape_fn(cfg))


_LAYER_MAP: dict[str, tuple[tuple[str, ...], Callable[[np.ndarray, LlamaConfig], np.ndarray]]] = {
    "input_layernorm.weight": (("input_layernorm", "scale"), lambda w, c: w),
    "post_attention_layernorm.weight": (("post_attention_layernorm", "scale"), lambda w, c: w),
    "post_feedforward_layernorm.weight": (("post_feedforward_layernorm", "scale"), lambda w, c: w),
    "post_self_attn_layernorm.weight": (("post_self_attn_layernorm", "scale"), lambda w, c: w),
    "post_mlp_layernorm.weight": (("post_mlp_layernorm", "scale"), lambda w, c: w),
    "self_attn.q_proj.weight": (
        ("self_attn", "q_proj"), _proj_in(lambda c: (c.hidden_size, c.num_heads, c.head_dim))),
    "self_attn.k_proj.weight": (
        ("self_attn", "k_proj"), _proj_in(lambda c: (c.hidden_size, c.num_kv_heads, c.head_dim))),
    "self_attn.v_proj.weight": (
        ("self_attn", "v_proj"), _proj_in(lambda c: (c.hidden_size, c.num_kv_heads, c.head_dim))),
    "self_attn.o_proj.weight": (
        ("self_attn", "o_proj"), _proj_in(lambda c: (c.num_heads, c.head_dim, c.hidden_size))),
    "self_attn.q_bias": (("self_attn", "q_bias"), lambda w, c: w.reshape(c.num_heads, c.head_dim)),
    "self_attn.k_bias": (("self_attn", "k_bias"), lambda w, c: w.reshape(c.num_kv_heads, c.head_dim)),
    "self_attn.v_bias": (("self_attn", "v_bias"), lambda w, c: w.reshape(c.num_kv_heads, c.head_dim)),
    "self_attn.o_proj.bias": (("self_attn", "o_bias"), lambda w, c: w),
    "self_attn.sinks": (("self_attn", "sinks"), lambda w, c: w),
    "self_attn.q_norm.weight": (("self_attn", "q_norm", "scale"), lambda w, c: w),
    "self_attn.k_norm.weight": (("self_attn", "k_norm", "scale"), lambda w, c: w),
    "mlp.gate_proj.weight": (("mlp", "gate_proj"), lambda w, c: w.T),
    "mlp.up_proj.weight": (("mlp", "up_proj"), lambda w, c: w.T),
    "mlp.down_proj.weight": (("mlp", "down_proj"), lambda w, c: w.T),
    # Mixture of experts: the router, and each kind of expert weight stacked by `hf_weight_stream`
    "mlp.gate.weight": (("mlp", "router"), lambda w, c: w.T),
    "block_sparse_moe.gate.weight": (("mlp", "router"), lambda w, c: w.T),
    "block_sparse_moe.router.layer.weight": (("mlp", "router"), lambda w, c: w.T),  # Granite-MoE's
    # Qwen2-MoE's shared expert, and its gate (one logit a token)
    "mlp.shared_expert.gate_proj.weight": (("mlp", "shared_expert", "gate_proj"), lambda w, c: w.T),
    "mlp.shared_expert.up_proj.weight": (("mlp", "shared_expert", "up_proj"), lambda w, c: w.T),
    "mlp.shared_expert.down_proj.weight": (("mlp", "shared_expert", "down_proj"), lambda w, c: w.T),
    "mlp.shared_expert_gate.weight": (("mlp", "shared_expert_gate"), lambda w, c: w.reshape(-1, 1)),  # [1, D] or [D]
    # DeepSeek-V3's and GLM-4.5's: the router's correction bias, an ungated shared expert
    "mlp.gate.e_score_correction_bias": (("mlp", "router_correction"), lambda w, c: np.asarray(w, np.float32)),
    **{f"mlp.shared_experts.{kind}_proj.weight": (("mlp", "shared_expert", f"{kind}_proj"), lambda w, c: w.T)
       for kind in ("gate", "up", "down")},
    # GPT-OSS's router and experts' biases (its experts' weights as the others', by `hf_weight_stream`)
    "mlp.router.weight": (("mlp", "router"), lambda w, c: w.T),
    "mlp.router.bias": (("mlp", "router_bias"), lambda w, c: w),
    "mlp.experts_gate_bias": (("mlp", "experts_gate_bias"), lambda w, c: w),
    "mlp.experts_up_bias": (("mlp", "experts_up_bias"), lambda w, c: w),
    "mlp.experts_down_bias": (("mlp", "experts_down_bias"), lambda w, c: w),
    "mlp.experts_gate": (("mlp", "experts_gate"), lambda w, c: np.swapaxes(w, 1, 2)),  # [E, F, D] -> [E, D, F]
    "mlp.experts_up": (("mlp", "experts_up"), lambda w, c: np.swapaxes(w, 1, 2)),
    "mlp.experts_down": (("mlp", "experts_down"), lambda w, c: np.swapaxes(w, 1, 2)),  # [E, D, F] -> [E, F, D]
}
# --enable-lora: where each PEFT target's stack sits (`lora.py`); the MoE layers' MLPs have none.
LORA_TARGETS, LORA_FUSED_TARGETS = layers.LORA_TARGETS, layers.LORA_FUSED_TARGETS


def lora_row_orders(cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """PEFT target -> the order its B rows take, where the model reorders its weights' rows at load (GLM-4's
    q and k, `_rotate_half_rows`); targets not named keep theirs."""
    if not cfg.interleaved_rope:
        return {}
    order = rotate_half_order(cfg.head_dim, cfg.rotary_dim)
    return {f"self_attn.{name}_proj": (np.arange(heads)[:, None] * cfg.head_dim + order).reshape(-1)
            for name, heads in (("q", cfg.num_heads), ("k", cfg.num_kv_heads))}
# Tensor parallelism (`jaxserve.parallel`): parameter name -> (axis split over devices, what it holds).
TENSOR_PARALLEL: dict[str, SplitRule] = {
    "lora_a": (None, None), "lora_b": (None, None),  # adapters' stacks: small, on every device
    "embed_tokens": (0, None), "lm_head": (0, None), "scale": (None, None), "score": (None, None),
    "q_proj": (1, "q"), "k_proj": (1, "kv"), "v_proj": (1, "kv"), "o_proj": (0, "q"),
    "q_bias": (0, "q"), "k_bias": (0, "kv"), "v_bias": (0, "kv"),
    "gate_proj": (1, None), "up_proj": (1, None), "down_proj": (0, None), "router": (None, None),
    "o_bias": (None, None), "shared_expert_gate": (None, None), "sinks": (0, "q"), "router_correction": (None, None),
    "router_bias": (None, None), "experts_down_bias": (None, None),  # the down biases are added after the split
    "experts_gate_bias": (1, None), "experts_up_bias": (1, None),  # [E, F]: by width, as the experts
    **dict(zip(("experts_gate", "experts_up", "experts_down"), ((axis, None) for axis in expert_split_axes(False)),
               strict=True)),
}
# Under --enable-expert-parallel the experts split whole instead (`split_rule`).
EXPERT_PARALLEL: dict[str, SplitRule] = {
    **dict(zip(("experts_gate", "experts_up", "experts_down"), ((axis, None) for axis in expert_split_axes(True)),
               strict=True)),
    "experts_gate_bias": (0, None), "experts_up_bias": (0, None),
}


def split_rule(name: str, cfg: LlamaConfig) -> SplitRule:
    """How the parameter `name` splits over a mesh (`TENSOR_PARALLEL`, the experts as the config lays them out)."""
    if cfg.moe is not None and cfg.moe.expert_parallel and name in EXPERT_PARALLEL:
        return EXPERT_PARALLEL[name]
    return TENSOR_PARALLEL[name]
_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")


def hf_weight_stream(tensors: Iterator[tuple[str, Any]], cfg: LlamaConfig) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors as the model keeps them: Phi-3's fused projections split, each layer's
    per-expert weights stacked into one [E, out, in] tensor per kind (`model.layers.i.mlp.experts_gate`...),
    yielded once its last expert has arrived (a GGUF file's blocks stacked as blocks, `stack_expert_tensors`),
    GPT-OSS's fused experts split (`_gpt_oss_experts`), and GLM-4's q and k rows in the rotate-half layout."""
    experts = ExpertStacker(cfg.moe.num_experts if cfg.moe is not None else 0)
    mxfp4: dict[str, dict[str, Any]] = {}  # GPT-OSS's MXFP4 experts: name -> whichever of blocks and scales came
    for name, tensor in tensors:
        if cfg.is_mtp_tensor(name):  # before its experts are stacked
            continue
        if cfg.moe is not None and cfg.moe.biases and (match := _MXFP4_RE.match(name)):  # GPT-OSS's
            stem, part = match.groups()
            parts = mxfp4.setdefault(stem, {})
            parts[part] = np.asarray(tensor)
            if len(parts) == 2:
                del mxfp4[stem]
                yield from _gpt_oss_experts(stem, decode_mxfp4(parts["blocks"], parts["scales"]), out_major=True)
            continue
        if cfg.moe is not None and cfg.moe.biases and _GPT_OSS_EXPERTS_RE.match(name):
            yield from _gpt_oss_experts(name, np.asarray(tensor), out_major=False)
            continue
        if (stacked := experts.add(name, tensor)) is not None:
            yield from stacked
            continue
        for part_name, part in _split_fused_weight(name, tensor, cfg):
            yield part_name, _rotate_half_rows(part_name, part, cfg)
    experts.check_complete()
    if mxfp4:
        stem, parts = next(iter(mxfp4.items()))
        missing = "scales" if "blocks" in parts else "blocks"
        raise ValueError(f"{stem}: MXFP4 {next(iter(parts))} without their {missing}")


_MXFP4_RE = re.compile(r"^(.*\.mlp\.experts\.(?:gate_up_proj|down_proj))_(blocks|scales)$")
_GPT_OSS_EXPERTS_RE = re.compile(r"^.*\.mlp\.experts\.(?:gate_up_proj|down_proj)(?:_bias)?$")


def _gpt_oss_experts(name: str, tensor: np.ndarray, out_major: bool) -> list[tuple[str, np.ndarray]]:
    """GPT-OSS's fused experts as the other mixtures' stacked ones: `gate_up_proj` [E, D, 2F] (in MXFP4,
    [E, 2F, D] once decoded: `out_major`) holds gate and up in alternate columns, its bias [E, 2F] likewise;
    `down_proj` is [E, F, D] ([E, D, F] in MXFP4). Weights come out [E, out, in], as `_LAYER_MAP` takes them."""
    stem, kind = name.rsplit(".experts.", 1)  # model.layers.N.mlp, gate_up_proj[_bias] | down_proj[_bias]
    if kind == "gate_up_proj_bias":
        return [(f"{stem}.experts_gate_bias", tensor[:, 0::2]), (f"{stem}.experts_up_bias", tensor[:, 1::2])]
    if kind == "down_proj_bias":
        return [(f"{stem}.experts_down_bias", tensor)]
    out_in = tensor if out_major else np.swapaxes(tensor, 1, 2)  # [E, out, in]
    if kind == "down_proj":
        return [(f"{stem}.experts_down", out_in)]
    return [(f"{stem}.experts_gate", out_in[:, 0::2]), (f"{stem}.experts_up", out_in[:, 1::2])]


_QK_ROWS_RE = re.compile(r"\.self_attn\.([qk])_proj\.(?:weight|bias)$")


def _rotate_half_rows(name: str, tensor: Any, cfg: LlamaConfig) -> Any:
    """A query or key projection's rows (or bias) reordered into the rotate-half layout, where the model's
    RoPE is interleaved (`rope_layout`); other tensors as they are."""
    if not cfg.interleaved_rope or (match := _QK_ROWS_RE.search(name)) is None:
        return tensor
    rows = tensor if isinstance(tensor, Fp8Tensor) else np.asarray(tensor)  # an FP8 tensor's rows keep their scales
    return to_rotate_half(rows, cfg.num_heads if match.group(1) == "q" else cfg.num_kv_heads,
                          cfg.rotary_dim)


def _split_fused_weight(name: str, tensor: Any, cfg: LlamaConfig) -> list[tuple[str, Any]]:
    """Phi-3's and Granite-MoE's fused projections as the separate tensors the other checkpoints hold:
    `qkv_proj` rows are [q (N*H), k (K*H), v (K*H)]; `gate_up_proj` rows, and Granite-MoE's shared
    `input_linear` rows, [gate (F), up (F)]; its experts' `input_linear` is [E, gate and up (2F), D], their
    `output_linear` [E, D, F] (stacked as `hf_weight_stream` stacks the others'). Other tensors pass as they are."""
    if name.endswith(".block_sparse_moe.input_linear.weight"):
        stem = name.removesuffix("block_sparse_moe.input_linear.weight")
        half = tensor.shape[1] // 2
        return [(stem + "mlp.experts_gate", tensor[:, :half]), (stem + "mlp.experts_up", tensor[:, half:])]
    if name.endswith(".block_sparse_moe.output_linear.weight"):
        return [(name.removesuffix("block_sparse_moe.output_linear.weight") + "mlp.experts_down", tensor)]
    if name.endswith(".shared_mlp.input_linear.weight"):
        stem = name.removesuffix("shared_mlp.input_linear.weight") + "mlp.shared_expert."
        half = tensor.shape[0] // 2
        return [(stem + "gate_proj.weight", tensor[:half]), (stem + "up_proj.weight", tensor[half:])]
    if name.endswith(".shared_mlp.output_linear.weight"):
        return [(name.removesuffix("shared_mlp.output_linear.weight") + "mlp.shared_expert.down_proj.weight", tensor)]
    if name.endswith(".self_attn.qkv_proj.weight"):
        stem = name.removesuffix("qkv_proj.weight")
        q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        if tensor.shape[0] != q_rows + 2 * kv_rows:
            raise ValueError(f"{name}: {tensor.shape[0]} rows, not {q_rows} + 2 x {kv_rows}")
        q, k, v = tensor[:q_rows], tensor[q_rows : q_rows + kv_rows], tensor[q_rows + kv_rows :]
        return [(stem + "q_proj.weight", q), (stem + "k_proj.weight", k), (stem + "v_proj.weight", v)]
    if name.endswith(".mlp.gate_up_proj.weight"):
        stem = name.removesuffix("gate_up_proj.weight")
        half = tensor.shape[0] // 2
        gate, up = tensor[:half], tensor[half:]
        return [(stem + "gate_proj.weight", gate), (stem + "up_proj.weight", up)]
    return [(name, tensor)]


def map_hf_weight(name: str, cfg: LlamaConfig) -> tuple[tuple[str | int, ...], Callable] | None:
    """Where an HF tensor goes in this model, or None for tensors the model has no use for (GLM-4.5's
    multi-token prediction layers, among them)."""
    name = re.sub(r"\.(q|k|v)_proj\.bias$", r".\1_bias", name)
    if match := _LAYER_RE.match(name):
        entry = _LAYER_MAP.get(match.group(2))
        if entry is None or cfg.is_mtp_tensor(name):
            return None
        path, transform = entry
        return ("layers", int(match.group(1)), *path), transform
    return map_outer_weight(name, cfg)


def map_outer_weight(name: str, cfg: Any) -> tuple[tuple[str | int, ...], Callable] | None:
    """Where the embeddings, the final norm and an untied LM head go in a Llama-style stack; None otherwise."""
    if name in ("model.embed_tokens.weight", "embed_tokens.weight"):
        return ("embed_tokens",), lambda w, c: w
    if name in ("model.norm.weight", "norm.weight"):
        return ("norm", "scale"), lambda w, c: w
    if name == "lm_head.weight" and not cfg.tie_word_embeddings:
        return ("lm_head",), lambda w, c: w
    return None
