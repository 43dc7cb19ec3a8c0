"""EAGLE-3 drafters (vLLM's "eagle3" method; Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test", 2025).

The target's feature at a position is the residual stream entering three of its layers, side by side
(`LlamaForCausalLM.hidden_and_layer_inputs`; by default layers 2, L / 2 and L - 3, or the config's
`eagle_config.eagle_aux_hidden_state_layer_ids`), which `fc` fuses into one [D] vector as it is copied into the
drafter's cache (`project_features`). The drafter's one layer takes [input_norm(embedding) ; hidden_norm(feature)]
([2D]) into its attention, the feature itself as the residual (normed first with `norm_before_residual`), and
its MLP as a Llama's; its output goes through a final norm into its own LM head over a draft vocabulary,
whose ids map to the target's by `d2t` (target id = draft id + d2t[draft id]). The output before that norm
stands in for the next position's feature when it runs ahead on its own drafts, as EAGLE's does.
"""

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.eagle import EagleConfig, drafter_caches, drafter_fields, drafter_inputs
from jaxserve.models.layers import (
    AttentionMetadata,
    GatedMlp,
    KVCache,
    RMSNorm,
    dense,
    logits_from_embeddings,
    param,
)
from jaxserve.models.llama import Attention, LlamaConfig, map_hf_weight


def is_eagle3_checkpoint(names: list[str]) -> bool:
    """Whether an EAGLE checkpoint's tensor names are an EAGLE-3 drafter's: a draft vocabulary's map, or the
    EAGLE authors' `midlayer`."""
    return any(name in ("d2t", "model.d2t") or name.startswith(("midlayer.", "model.midlayer.")) for name in names)


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs EAGLE-3 reads where its config names none (vLLM's and the authors'):
    2, L / 2 and L - 3."""
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclass(frozen=True)
class Eagle3Config(EagleConfig):
    """An EAGLE-3 drafter's: its layer as a Llama's, `feature_width` its own hidden size (the fused feature)."""

    target_layers: tuple[int, ...] = ()  # the target's layers whose inputs make its feature, ascending
    target_hidden_size: int = 0
    draft_vocab_size: int = 0
    norm_before_residual: bool = False
    own_embeddings: bool = False  # the checkpoint has its embeddings (else the target's)

    @classmethod
    def for_target(cls, hf: Any, target_cfg: Any, names: list[str], attention: Any) -> "Eagle3Config":
        """The drafter of `hf` (its config.json) beside a target of config `target_cfg`, its checkpoint's
        tensors `names`; raises ValueError where it cannot draft for it."""
        base = LlamaConfig.from_hf(hf, attention)
        if base.num_layers != 1:
            raise ValueError(f"an EAGLE-3 drafter of {base.num_layers} layers: one is served")
        eagle = getattr(hf, "eagle_config", None) or {}
        num_target_layers = target_cfg.num_layers
        # vLLM's order: the config's top-level key, then its eagle_config's, then the default; taken in layer order
        named = getattr(hf, "eagle_aux_hidden_state_layer_ids", None) or eagle.get("eagle_aux_hidden_state_layer_ids")
        layers = tuple(sorted(set(named or default_aux_layers(num_target_layers))))
        if not all(0 <= layer < num_target_layers for layer in layers):
            raise ValueError(f"the EAGLE-3 drafter reads the inputs of target layers {list(layers)}: the target has "
                             f"{num_target_layers}")
        if eagle.get("use_aux_hidden_state") is False:
            raise ValueError("an EAGLE-3 drafter without auxiliary hidden states (use_aux_hidden_state false) is "
                             "not served")
        target_hidden = getattr(hf, "target_hidden_size", None) or base.hidden_size
        if target_hidden != target_cfg.hidden_size:
            raise ValueError(f"an EAGLE-3 drafter for a target of hidden size {target_hidden} cannot read one of "
                             f"{target_cfg.hidden_size}")
        fields = drafter_fields(base, hf, target_cfg, "EAGLE-3")
        own = any(name.endswith("embed_tokens.weight") for name in names)
        if not own and base.hidden_size != target_cfg.hidden_size:
            raise ValueError(f"an EAGLE-3 drafter of hidden size {base.hidden_size} without embeddings of its own "
                             f"cannot take the target's ({target_cfg.hidden_size} wide)")
        return cls(**fields, feature_width=base.hidden_size, target_layers=layers, target_hidden_size=target_hidden,
                   draft_vocab_size=getattr(hf, "draft_vocab_size", None) or base.vocab_size,
                   norm_before_residual=bool(getattr(hf, "norm_before_residual", False)), own_embeddings=own)


class Eagle3Layer(nnx.Module):
    """The drafter's layer: attention over [embedding ; feature], the feature as its residual."""

    def __init__(self, cfg: Eagle3Config, dtype: Any, weight_dtype: Any) -> None:
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps, dtype)
        self.hidden_norm = RMSNorm(d, eps, dtype)
        self.self_attn = Attention(cfg, dtype, weight_dtype, 0, input_size=2 * d)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype)
        self.mlp = GatedMlp(d, cfg.intermediate_size, weight_dtype, cfg.attention, None, "silu")
        self.norm_before_residual = cfg.norm_before_residual

    def __call__(self, embedded, fed, positions, kv_cache, md):  # [T, D] each -> ([T, D], kv_cache)
        normed = self.hidden_norm(fed)
        residual = normed if self.norm_before_residual else fed
        attn_out, kv_cache = self.self_attn(jnp.concatenate([self.input_layernorm(embedded), normed], axis=-1),
                                            positions, kv_cache, md)
        residual = residual + attn_out
        return residual + self.mlp(self.post_attention_layernorm(residual)), kv_cache


class Eagle3Llama(nnx.Module):
    """The drafter: `__call__` as a model's (its final-normed output, whose logits are its drafts'), over a KV
    cache whose last entry holds its fused features."""

    reads_features = True

    def __init__(self, cfg: Eagle3Config, dtype: Any, weight_dtype: Any = None) -> None:
        weight_dtype = weight_dtype or dtype
        d = cfg.hidden_size
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = param(cfg.vocab_size, d, dtype=weight_dtype)  # its own, or the target's
        self.fc = param(len(cfg.target_layers) * cfg.target_hidden_size, d, dtype=weight_dtype)
        self.layers = nnx.List([Eagle3Layer(cfg, dtype, weight_dtype)])
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.lm_head = param(cfg.draft_vocab_size, d, dtype=weight_dtype)
        self.draft_to_target = nnx.Param(jnp.zeros(cfg.draft_vocab_size, jnp.int32))  # target id of each draft id

    def project_features(self, target_features: jax.Array) -> jax.Array:  # [T, len * Dt] -> [T, D]
        """The target's features fused into the drafter's (`fc`), as they are copied into its cache."""
        return dense(target_features.astype(self.dtype), self.fc[...], self.cfg.attention)

    def __call__(
        self,
        input_ids: jax.Array,  # i32[T]: the token at each position's next one
        positions: jax.Array,  # i32[T]
        kv_caches: KVCache,  # its layer's K/V, then (features [1, pages, page_size, D], None)
        md: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:  # [T, D], normed
        embedded, fed, features, (layer_cache,) = drafter_inputs(self.embed_tokens[...], input_ids, kv_caches, md,
                                                                 self.cfg.attention, self.dtype)
        out, layer_cache = self.layers[0](embedded, fed, positions, layer_cache, md)
        return self.norm(out), drafter_caches([layer_cache], features, out, positions, md)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [R, D] -> f32[R, V]: the target's vocabulary
        """The draft vocabulary's logits at their target ids, -inf at the others."""
        logits = logits_from_embeddings(hidden, self.lm_head[...], self.cfg.attention)  # f32[R, Vd]
        full = jnp.full((hidden.shape[0], self.cfg.vocab_size), -jnp.inf, jnp.float32)
        return full.at[:, self.draft_to_target[...]].set(logits, mode="drop")


def shared_tables(cfg: Eagle3Config, names: list[str], head: Any, embeddings: Any) -> dict[tuple, Any]:
    """What the drafter takes of the target where its checkpoint has none: the embeddings, and (for a draft
    vocabulary that is the target's) the LM head and an identity `d2t`."""
    shared: dict[tuple, Any] = {}
    if not cfg.own_embeddings:
        shared["embed_tokens",] = embeddings
    if not any(name.endswith("lm_head.weight") for name in names):
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise ValueError("the EAGLE-3 checkpoint has a draft vocabulary and no lm_head.weight")
        shared["lm_head",] = head
    if not any(name.endswith("d2t") for name in names):
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise ValueError("the EAGLE-3 checkpoint has a draft vocabulary and no d2t to map it")
        shared["draft_to_target",] = jnp.arange(cfg.vocab_size, dtype=jnp.int32)
    return shared


def _qkv_in(heads_of: Any) -> Any:
    """A q/k/v projection [N*H, 2D] of the drafter's layer as the model keeps it, [2D, N, H]."""
    return lambda w, c: w.T.reshape(w.shape[1], heads_of(c), c.head_dim)


_LAYER_NAMES = {
    "self_attn.q_proj.weight": _qkv_in(lambda c: c.num_heads),
    "self_attn.k_proj.weight": _qkv_in(lambda c: c.num_kv_heads),
    "self_attn.v_proj.weight": _qkv_in(lambda c: c.num_kv_heads),
}


def map_eagle3_weight(name: str, cfg: Eagle3Config) -> tuple[tuple[str | int, ...], Any] | None:
    """Where an EAGLE-3 checkpoint's tensor goes in `Eagle3Llama` (with its transform), or None for those it has
    no use for (`t2d`)."""
    name = name.removeprefix("model.")
    name = "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name
    if name == "fc.weight":
        return ("fc",), lambda w, c: w.T
    if name == "d2t":
        return ("draft_to_target",), lambda w, c: (jnp.arange(w.shape[0]) + w).astype(jnp.int32)
    if name == "t2d":
        return None
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return (name.split(".")[0],), lambda w, c: w
    if name == "norm.weight":
        return ("norm", "scale"), lambda w, c: w
    if name == "layers.0.hidden_norm.weight":
        return ("layers", 0, "hidden_norm", "scale"), lambda w, c: w
    if (inner := name.removeprefix("layers.0.")) in _LAYER_NAMES:
        return ("layers", 0, *_split(inner)), _LAYER_NAMES[inner]
    return map_hf_weight(name, cfg)


def _split(name: str) -> tuple[str, str]:
    """'self_attn.q_proj.weight' -> ('self_attn', 'q_proj')."""
    module, projection, _ = name.split(".")
    return module, projection
