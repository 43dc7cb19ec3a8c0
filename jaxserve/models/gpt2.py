"""GPT-2 (`GPT2LMHeadModel`) in Flax NNX.

Axis letters: T tokens, D hidden, N heads, H head dim, F MLP width, V vocab, C the q/k/v triple.
"""

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models.layers import (
    AttentionMetadata,
    KVCache,
    LayerNorm,
    apply_layers,
    dense,
    embedding_lookup,
    logits_from_embeddings,
    merge_heads,
    paged_attention,
    param,
)
from jaxserve.models.quantization import Fp8Weight
from jaxserve.ops.attention import AttentionConfig
from jaxserve.parallel import SplitRule


@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    layer_norm_eps: float
    max_position_embeddings: int
    attention: AttentionConfig = field(default_factory=AttentionConfig)  # resolved for the compile device

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @classmethod
    def from_hf(cls, hf: Any, attention: AttentionConfig | None = None) -> "GPT2Config":
        if getattr(hf, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported GPT-2 activation {hf.activation_function!r}")
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.n_embd,
            intermediate_size=hf.n_inner or 4 * hf.n_embd,
            num_layers=hf.n_layer,
            num_heads=hf.n_head,
            head_dim=hf.n_embd // hf.n_head,
            layer_norm_eps=hf.layer_norm_epsilon,
            max_position_embeddings=hf.n_positions,
            attention=attention or AttentionConfig(),
        )

    def with_heads(self, num_heads: int, num_kv_heads: int) -> "GPT2Config":
        """The same model with its heads laid out for tensor parallelism (`jaxserve.parallel.HeadLayout`)."""
        if num_kv_heads != num_heads:
            raise ValueError("GPT-2 has as many KV heads as query heads")
        return dataclasses.replace(self, num_heads=num_heads)


class Block(nnx.Module):
    def __init__(self, cfg: GPT2Config, dtype: Any, weight_dtype: Any) -> None:
        d, n, h, f = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
        self.ln_1 = LayerNorm(d, cfg.layer_norm_eps, dtype)
        self.qkv = param(d, 3, n, h, dtype=weight_dtype)
        self.qkv_bias = param(3, n, h, dtype=dtype)
        self.attn_out = param(n, h, d, dtype=weight_dtype)
        self.attn_out_bias = param(d, dtype=dtype)
        self.ln_2 = LayerNorm(d, cfg.layer_norm_eps, dtype)
        self.fc = param(d, f, dtype=weight_dtype)
        self.fc_bias = param(f, dtype=dtype)
        self.proj = param(f, d, dtype=weight_dtype)
        self.proj_bias = param(d, dtype=dtype)
        self.attention = cfg.attention

    def __call__(self, x, kv_cache, md: AttentionMetadata):
        attention, w_qkv = self.attention, self.qkv[...]  # [D, 3, N, H]
        if attention.mesh is None:  # one 2-D matmul (see `project_heads`)
            qkv = dense(self.ln_1(x), w_qkv.reshape(w_qkv.shape[0], -1), attention)
            qkv = qkv.reshape(x.shape[0], *w_qkv.shape[1:]).swapaxes(0, 1)  # [3, T, N, H]
        else:  # the head axis, split over the mesh, is not the major part of 3 x N
            if isinstance(w_qkv, Fp8Weight):  # this einsum takes the weight whole
                w_qkv = w_qkv.dequantize(x.dtype)
            qkv = jnp.einsum("TD,DCNH->CTNH", self.ln_1(x).astype(w_qkv.dtype), w_qkv,
                             preferred_element_type=jnp.float32).astype(x.dtype)
        qkv = qkv + self.qkv_bias[...][:, None]
        attn, kv_cache = paged_attention(qkv[0], qkv[1], qkv[2], kv_cache, md, attention=attention)
        x = x + merge_heads(attn, self.attn_out[...], attention) + self.attn_out_bias[...]
        hidden = dense(self.ln_2(x), self.fc[...], attention) + self.fc_bias[...]
        hidden = jax.nn.gelu(hidden, approximate=True)
        return x + dense(hidden, self.proj[...], attention, split_contracted=True) + self.proj_bias[...], kv_cache


class GPT2LMHeadModel(nnx.Module):
    def __init__(self, cfg: GPT2Config, dtype: Any, weight_dtype: Any = None) -> None:
        """`dtype`: activations, norms, biases, position embeddings; `weight_dtype` (None: `dtype`): the
        projections and the token embeddings (also the LM head)."""
        weight_dtype = weight_dtype or dtype
        self.cfg = cfg
        self.dtype = dtype
        self.wte = param(cfg.vocab_size, cfg.hidden_size, dtype=weight_dtype)
        self.wpe = param(cfg.max_position_embeddings, cfg.hidden_size, dtype=dtype)
        self.h = nnx.List([Block(cfg, dtype, weight_dtype) for _ in range(cfg.num_layers)])
        self.ln_f = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def __call__(
        self,
        input_ids: jax.Array,  # i32[T]
        positions: jax.Array,  # i32[T]
        kv_caches: KVCache,
        md: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:  # [T, D]
        x = embedding_lookup(self.wte[...], input_ids, self.cfg.attention.mesh).astype(self.dtype)
        x = x + self.wpe[...][positions]
        x, new_caches = apply_layers(self.h, x, kv_caches, md=md)
        return self.ln_f(x), new_caches

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [R, D] -> f32[R, V]
        return logits_from_embeddings(hidden, self.wte[...], self.cfg.attention)


LAYERS_KEY = "h"  # the blocks' list in the model's state (`kv_scales.fold_kv_scales`)
# `--quantization fp8`: the blocks' dense weights, each with its number of contracted axes (`quantization.py`).
QUANTIZED_WEIGHTS = {"qkv": 1, "attn_out": 2, "fc": 1, "proj": 1}


def kv_scale_factor(cfg: GPT2Config, path: tuple, k_scale: float, v_scale: float) -> Any:
    """What a block's parameter at `path` is multiplied by to fold an FP8 cache's scales into the weights
    (`kv_scales.py`); the fused q/k/v weight [D, 3, N, H] and bias [3, N, H] take one factor per part."""
    qkv = np.asarray([k_scale, 1.0 / k_scale, 1.0 / v_scale], np.float32)
    return {("qkv",): qkv[None, :, None, None], ("qkv_bias",): qkv[:, None, None],
            ("attn_out",): v_scale}.get(path)


# HF names -> (NNX path, transform). GPT-2 uses Conv1D, whose weights are already [in, out].
_BLOCK_MAP: dict[str, tuple[tuple[str, ...], Callable[[np.ndarray, GPT2Config], np.ndarray]]] = {
    "ln_1.weight": (("ln_1", "scale"), lambda w, c: w),
    "ln_1.bias": (("ln_1", "bias"), lambda w, c: w),
    "ln_2.weight": (("ln_2", "scale"), lambda w, c: w),
    "ln_2.bias": (("ln_2", "bias"), lambda w, c: w),
    "attn.c_attn.weight": (("qkv",), lambda w, c: w.reshape(c.hidden_size, 3, c.num_heads, c.head_dim)),
    "attn.c_attn.bias": (("qkv_bias",), lambda w, c: w.reshape(3, c.num_heads, c.head_dim)),
    "attn.c_proj.weight": (("attn_out",), lambda w, c: w.reshape(c.num_heads, c.head_dim, c.hidden_size)),
    "attn.c_proj.bias": (("attn_out_bias",), lambda w, c: w),
    "mlp.c_fc.weight": (("fc",), lambda w, c: w),
    "mlp.c_fc.bias": (("fc_bias",), lambda w, c: w),
    "mlp.c_proj.weight": (("proj",), lambda w, c: w),
    "mlp.c_proj.bias": (("proj_bias",), lambda w, c: w),
}
# Tensor parallelism (`jaxserve.parallel`): parameter name -> (axis split over devices, what it holds).
# wte is also the LM head; position embeddings and layer norms are replicated.
TENSOR_PARALLEL: dict[str, SplitRule] = {
    "wte": (0, None), "wpe": (None, None), "scale": (None, None), "bias": (None, None),
    "qkv": (2, "qkv"), "qkv_bias": (1, "qkv"), "attn_out": (0, "q"), "attn_out_bias": (None, None),
    "fc": (1, None), "fc_bias": (0, None), "proj": (0, None), "proj_bias": (None, None),
}
_BLOCK_RE = re.compile(r"^(?:transformer\.)?h\.(\d+)\.(.+)$")


def map_hf_weight(name: str, cfg: GPT2Config) -> tuple[tuple[str | int, ...], Callable] | None:
    """Where an HF tensor goes in this model, or None for buffers and the tied lm_head."""
    if match := _BLOCK_RE.match(name):
        entry = _BLOCK_MAP.get(match.group(2))
        if entry is None:
            return None  # attn.bias / attn.masked_bias are causal-mask buffers
        path, transform = entry
        return ("h", int(match.group(1)), *path), transform
    short = name.removeprefix("transformer.")
    if short in ("wte.weight", "wpe.weight"):
        return (short.split(".")[0],), lambda w, c: w
    if short in ("ln_f.weight", "ln_f.bias"):
        return ("ln_f", "scale" if short.endswith("weight") else "bias"), lambda w, c: w
    return None
