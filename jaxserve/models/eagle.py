"""EAGLE drafters for speculative decoding (vLLM's "eagle" method; Li et al., "EAGLE: Speculative Sampling
Requires Rethinking Feature Uncertainty", 2024).

An EAGLE drafter is one (or a few) Llama decoder layers beside the target. At position j it takes the token at
j + 1 and the target's final hidden state at j (its "feature"), fused by `fc` ([2D] -> [D]), runs its layers
over its own K/V of the positions before, and its output through the target's LM head predicts the token at
j + 2. Its output also stands in for the target's feature at j + 1 when it runs ahead on its own drafts. As
the EAGLE authors' and vLLM's models do, the first layer has no input norm and the stack no final norm; the
embeddings and the LM head are the target's (a checkpoint's own embeddings are the target's copy). `fc`'s bias
is applied where the checkpoint has one (the EAGLE authors' checkpoints), and HASS's norms of the embedding
and the feature before it where the config says `add_para_norm`.

The features come through the last entry of the drafter's KV cache (`models/features.py`): each position
reads its feature from its own slot there, and writes its output to the next position's slot, for the draft
that follows it.
"""

import logging
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import Mesh

from jaxserve.models import ModelSpec
from jaxserve.models.features import read_features, write_features
from jaxserve.models.layers import (
    AttentionMetadata,
    GatedMlp,
    KVCache,
    RMSNorm,
    apply_layers,
    dense,
    embedding_lookup,
    logits_from_embeddings,
    param,
)
from jaxserve.models.llama import Attention, LlamaConfig, LlamaForCausalLM, map_hf_weight
from jaxserve.models.llama import split_rule as llama_split_rule
from jaxserve.models.loader import LoadedModel, safetensors_header
from jaxserve.models.source import load_hf_config, resolve_model
from jaxserve.parallel import HeadLayout, SplitRule, param_sharding

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EagleConfig(LlamaConfig):
    """The drafter's layers as a Llama's (`num_layers` of them), and its input's."""

    feature_width: int = 0  # F: the target's hidden size, each position's feature
    fc_bias: bool = False  # `fc` has a bias (the EAGLE authors' checkpoints)
    para_norms: bool = False  # HASS's `add_para_norm`: the embedding and the feature each RMS-normed before `fc`

    @classmethod
    def for_target(cls, hf: Any, target_cfg: Any, fc_bias: bool, attention: Any) -> "EagleConfig":
        """The drafter of `hf` (its config.json, a Llama's) beside a target of config `target_cfg`; raises
        ValueError where it cannot draft for it."""
        base = LlamaConfig.from_hf(hf, attention)
        if base.hidden_size != target_cfg.hidden_size:
            raise ValueError(f"an EAGLE drafter of hidden size {base.hidden_size} cannot read a target's features of "
                             f"{target_cfg.hidden_size}")
        return cls(**drafter_fields(base, hf, target_cfg, "EAGLE"), feature_width=target_cfg.hidden_size,
                   fc_bias=fc_bias, para_norms=bool(getattr(hf, "add_para_norm", False)))


def drafter_fields(base: LlamaConfig, hf: Any, target_cfg: Any, kind: str) -> dict[str, Any]:
    """A drafter's Llama config fields (`base`, from its config.json `hf`) over the target's vocabulary, padded as
    the target's embeddings and LM head are; raises ValueError where the drafter's own vocabulary is larger.
    Its layers' sliding windows are those its `layer_types` give them, as vLLM reads a drafter's config: a bare
    `sliding_window` copied from a windowed target's config does not make the drafter's attention windowed."""
    if base.vocab_size > target_cfg.vocab_size:
        raise ValueError(f"the {kind} drafter's vocabulary ({base.vocab_size}) is larger than the target's "
                         f"({target_cfg.vocab_size})")
    fields = {name: getattr(base, name) for name in LlamaConfig.__dataclass_fields__}
    windows = base.sliding_windows if getattr(hf, "layer_types", None) else ()
    if windows != base.sliding_windows:
        logger.info("the %s drafter attends to every position: its config's sliding_window comes without "
                    "layer_types", kind)
    return fields | {"vocab_size": target_cfg.vocab_size, "tie_word_embeddings": False, "sliding_windows": windows}


class EagleLayer(nnx.Module):
    """A Llama decoder layer; the first of the stack takes its input un-normed."""

    def __init__(self, cfg: EagleConfig, dtype: Any, weight_dtype: Any, layer: int) -> None:
        d = cfg.hidden_size
        if layer > 0:
            self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, weight_dtype, layer)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.mlp = GatedMlp(d, cfg.intermediate_size, weight_dtype, cfg.attention, None, "silu")
        self.normed_input = layer > 0

    def __call__(self, x, positions, kv_cache, md):
        h = self.input_layernorm(x) if self.normed_input else x
        attn_out, kv_cache = self.self_attn(h, positions, kv_cache, md)
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


class EagleLlama(nnx.Module):
    """The drafter: `__call__` as a model's, over a KV cache whose last entry holds its features."""

    reads_features = True

    def __init__(self, cfg: EagleConfig, dtype: Any, weight_dtype: Any = None) -> None:
        weight_dtype = weight_dtype or dtype
        d = cfg.hidden_size
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = param(cfg.vocab_size, d, dtype=weight_dtype)  # the target's
        self.fc = param(d + cfg.feature_width, d, dtype=weight_dtype)  # [embedding ; feature] -> D
        if cfg.fc_bias:
            self.fc_bias = param(d, dtype=dtype)
        if cfg.para_norms:
            self.embedding_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype)
            self.hidden_states_layernorm = RMSNorm(cfg.feature_width, cfg.rms_norm_eps, dtype)
        self.layers = nnx.List([EagleLayer(cfg, dtype, weight_dtype, i) for i in range(cfg.num_layers)])
        self.lm_head = param(cfg.vocab_size, d, dtype=weight_dtype)  # the target's

    def __call__(
        self,
        input_ids: jax.Array,  # i32[T]: the token at each position's next one
        positions: jax.Array,  # i32[T]
        kv_caches: KVCache,  # the layers' K/V, then (features [1, pages, page_size, F], None)
        md: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:  # [T, D]
        attention = self.cfg.attention
        embedded, fed, features, layer_caches = drafter_inputs(self.embed_tokens[...], input_ids, kv_caches, md,
                                                               attention, self.dtype)
        if self.cfg.para_norms:
            embedded, fed = self.embedding_layernorm(embedded), self.hidden_states_layernorm(fed)
        x = dense(jnp.concatenate([embedded, fed], axis=-1), self.fc[...], attention)
        if self.cfg.fc_bias:
            x = x + self.fc_bias[...]
        x, layer_caches = apply_layers(self.layers, x, layer_caches, positions=positions, md=md)
        return x, drafter_caches(layer_caches, features, x, positions, md)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [R, D] -> f32[R, V]
        return logits_from_embeddings(hidden, self.lm_head[...], self.cfg.attention)


def drafter_inputs(
    embed_tokens: jax.Array,  # [V, D]
    input_ids: jax.Array,  # i32[T]: the token at each position's next one
    kv_caches: KVCache,  # its layers' K/V, then (features [1, pages, page_size, F], None)
    md: AttentionMetadata,
    attention: Any,
    dtype: Any,
) -> tuple[jax.Array, jax.Array, jax.Array, KVCache]:
    """What an EAGLE or MTP drafter's step starts from: each token's embedding [T, D] and the feature at its own
    slot [T, F] (in `dtype`), the features' page array, and its layers' caches."""
    (features, _), layer_caches = kv_caches[-1], kv_caches[:-1]
    embedded = embedding_lookup(embed_tokens, input_ids, attention.mesh).astype(dtype)
    return embedded, read_features(features, md.slot_mapping).astype(dtype), features, layer_caches


def drafter_caches(layer_caches: KVCache, features: jax.Array, out: jax.Array, positions: jax.Array,
                   md: AttentionMetadata) -> KVCache:
    """An EAGLE or MTP drafter's KV cache after its step: its layers' caches, and each token's output [T, F]
    written as the feature of the position after it (`next_slots`), for the draft that follows it."""
    features = write_features(features, out, next_slots(md, positions, features.shape[1], features.shape[2]))
    return [*layer_caches, (features, None)]


def next_slots(md: AttentionMetadata, positions: jax.Array, num_pages: int, page_size: int) -> jax.Array:  # i32[T]
    """Each token's slot for the position after it, through its request's page table; padding tokens' (and a
    position past the table's pages) past the cache, where writes are dropped."""
    num_tokens, num_rows = positions.shape[0], md.page_table.shape[0]
    if md.decode_only:
        rows = jnp.arange(num_tokens)
    else:
        rows = jnp.searchsorted(md.cu_q_lens, jnp.arange(num_tokens), side="right") - 1
    rows = jnp.clip(rows, 0, num_rows - 1)
    after = positions + 1
    pages = md.page_table.at[rows, after // page_size].get(mode="fill", fill_value=num_pages)
    padding = num_pages * page_size
    return jnp.where(md.slot_mapping >= padding, padding, pages * page_size + after % page_size)


# Checkpoint names -> the drafter's, besides its layers' (a Llama's, `llama.map_hf_weight`)
_FC = re.compile(r"^(?:model\.)?(?:fc|fusion_fc)\.(weight|bias)$")
_PARA_NORM = re.compile(r"^(?:model\.)?(embedding_layernorm|hidden_states_layernorm)\.weight$")
_IGNORED = re.compile(r"^(?:model\.)?(?:embed_tokens\.weight|lm_head\.weight|norm\.weight)$")


def is_eagle_checkpoint(names: list[str]) -> bool:
    """Whether checkpoint tensor names are an EAGLE drafter's: an `fc` beside Llama layers."""
    return any(_FC.match(name) for name in names)


def map_eagle_weight(name: str, cfg: EagleConfig) -> tuple[tuple[str | int, ...], Any] | None:
    """Where an EAGLE checkpoint's tensor goes in `EagleLlama` (with its transform), or None for tensors it
    takes from the target or has no use for (the first layer's input norm, where a checkpoint keeps one)."""
    if match := _FC.match(name):
        return (("fc",), lambda w, c: w.T) if match.group(1) == "weight" else (("fc_bias",), lambda w, c: w)
    if match := _PARA_NORM.match(name):
        return (match.group(1), "scale"), lambda w, c: w
    if _IGNORED.match(name):
        return None
    if re.match(r"^(?:model\.)?layers\.0\.input_layernorm\.", name):
        return None
    return map_hf_weight(name, cfg)


@dataclass(frozen=True)
class DrafterLayout:
    """Where a drafter's weights live beside a target split over a mesh: each parameter split as `rule` (its
    name -> `SplitRule`) says, its heads laid out by `heads` (the drafter's own: `HeadLayout`)."""

    mesh: Mesh
    heads: HeadLayout
    rule: Callable[[str], SplitRule]

    @classmethod
    def beside(cls, target: LoadedModel, num_heads: int, num_kv_heads: int,
               rule: Callable[[str], SplitRule]) -> "DrafterLayout | None":
        """The layout of a drafter of `num_heads` query and `num_kv_heads` KV heads (its checkpoint's) beside
        `target`; None for a target on one device."""
        return cls.over(target.mesh, num_heads, num_kv_heads, rule)

    @classmethod
    def over(cls, mesh: Mesh | None, num_heads: int, num_kv_heads: int,
             rule: Callable[[str], SplitRule]) -> "DrafterLayout | None":
        """`beside` a target split over `mesh` (None: one device, no layout)."""
        return None if mesh is None else cls(mesh, HeadLayout(num_heads, num_kv_heads, mesh.size), rule)

    def sharding(self, path: tuple, shape: tuple[int, ...]) -> Any:
        """Where the parameter at `path`, of `shape` in the module's (laid-out) layout, lives over the mesh."""
        return param_sharding(self.mesh, shape, self.rule(path[-1]))

    def config(self, cfg: Any) -> Any:
        """The drafter's config (its checkpoint's, `cfg`) with its heads laid out for the mesh."""
        heads = self.heads
        return cfg if heads.is_identity else cfg.with_heads(heads.num_heads_eff, heads.num_kv_heads_eff)

    def place(self, path: tuple, value: Any, dtype: Any) -> jax.Array:
        """A checkpoint tensor, in the module's layout, with its heads laid out and split over the mesh."""
        axis, heads = self.rule(path[-1])
        value = np.asarray(self.heads.apply(heads, np.asarray(value), axis), dtype=dtype)
        return jax.device_put(value, param_sharding(self.mesh, value.shape, (axis, heads)))


def split_rule(name: str, cfg: Any) -> SplitRule:
    """How an EAGLE drafter's parameter `name` splits over a mesh: `fc` and its bias (small beside the layers)
    and EAGLE-3's vocabulary map whole on every device, the rest as a Llama's."""
    return _WHOLE.get(name) or llama_split_rule(name, cfg)


_WHOLE: dict[str, SplitRule] = {"fc": (None, None), "fc_bias": (None, None), "draft_to_target": (None, None)}


def load_drafter_state(directory: Path, module: Any, cfg: Any, dtype: Any, weight_dtype: Any, mapper: Any,
                       shared: dict[tuple, Any], layout: DrafterLayout | None = None
                       ) -> tuple[nnx.GraphDef, nnx.State]:
    """A drafter's module (`module(cfg, dtype, weight_dtype)`, its heads laid out by `layout` where the target
    is split over a mesh) and weights: its checkpoint's (`*.safetensors` in `directory`, named by `mapper(name,
    cfg)` -> (path, transform) or None) over `shared` (path -> the target's arrays, not copied)."""
    from safetensors import safe_open

    def weights() -> Iterator[tuple[str, tuple, Any]]:
        for file in sorted(directory.glob("*.safetensors")):
            with safe_open(str(file), framework="numpy") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if (mapped := mapper(name, cfg)) is not None:
                        path, transform = mapped
                        yield name, path, transform(f.get_tensor(name), cfg)

    return drafter_state(module, cfg, dtype, weight_dtype, weights(), shared, layout)


def drafter_state(module: Any, cfg: Any, dtype: Any, weight_dtype: Any, weights: Iterable[tuple[str, tuple, Any]],
                  shared: dict[tuple, Any], layout: DrafterLayout | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """A drafter's module (`module(cfg, dtype, weight_dtype)`, `cfg` its checkpoint's, its heads laid out by
    `layout` where the target is split over a mesh) and weights: `weights` (checkpoint name, path, value as the
    module keeps it), each split over the mesh as `layout` says, over `shared` (path -> the target's arrays, not
    copied; a weight of the same path takes its place); raises ValueError for a tensor that fits no parameter
    and for parameters left without one."""
    module_cfg = cfg if layout is None else layout.config(cfg)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: module(module_cfg, dtype, weight_dtype)))
    expected = traverse_util.flatten_dict(nnx.to_pure_dict(state))
    loaded: dict[tuple, Any] = dict(shared)
    for name, path, value in weights:
        if path not in expected:
            raise ValueError(f"the drafter's checkpoint tensor {name} maps to no parameter ({path})")
        want = expected[path]
        if layout is not None:
            loaded[path] = layout.place(path, value, want.dtype)
        else:
            loaded[path] = jax.device_put(jnp.asarray(value, dtype=want.dtype))
        if tuple(loaded[path].shape) != tuple(want.shape):
            raise ValueError(f"the drafter's checkpoint {name}: shape {np.shape(value)} != {want.shape}")
    missing = sorted(str(path) for path in expected.keys() - loaded.keys())
    if missing:
        raise ValueError(f"the drafter's checkpoint is missing {', '.join(missing[:5])}")
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(loaded))
    return graphdef, state


def target_tables(target_state: nnx.State) -> tuple[Any, Any]:
    """A Llama-style target's (LM head, embeddings) [V, D] each, as it keeps them (arrays, or a GGUF file's
    blocks: `gguf_weights.GgufTable`), its embeddings twice where they are tied; raises ValueError for a target
    of another stack (GPT-2's)."""
    weights = nnx.to_pure_dict(target_state)
    if "embed_tokens" not in weights:
        raise ValueError("an EAGLE or MTP drafter shares the target's embeddings and LM head: a Llama-style "
                         "target (LlamaForCausalLM and the families built on it)")
    embeddings = weights["embed_tokens"]
    return weights.get("lm_head", embeddings), embeddings


def checkpoint_names(directory: Path) -> list[str]:
    """The tensor names in a directory's `*.safetensors` files (their headers alone)."""
    return [name for file in sorted(directory.glob("*.safetensors")) for name in safetensors_header(str(file))]


def load_eagle(model: str, target: LoadedModel, method: str = "eagle", revision: str | None = None,
               download_dir: str | None = None) -> LoadedModel:
    """The EAGLE drafter `model` (a directory or hub id: config.json, a Llama's, and safetensors with `fc`;
    `method` "eagle3" for an EAGLE-3 one, `models/eagle3.py`) beside `target` (loaded, a Llama-style stack on
    one device), in the target's dtypes and attention; it shares the target's tokenizer, and its embeddings and
    LM head where it has none of its own. Raises ValueError where it cannot draft for it."""
    from jaxserve.models import eagle3

    source = resolve_model(model, revision, download_dir)
    if source.gguf_file:
        raise ValueError("an EAGLE drafter is a safetensors checkpoint, not a GGUF file")
    names = checkpoint_names(source.directory)
    if not names:
        raise ValueError(f"{model} has no *.safetensors files (a pytorch_model.bin is not read: "
                         "safetensors.torch.save_file converts it)")
    if not is_eagle_checkpoint(names):
        raise ValueError(f"{model} is not an EAGLE drafter: its checkpoint has no fc.weight")
    if (method == "eagle3") != eagle3.is_eagle3_checkpoint(names):
        kind = "an EAGLE-3" if method == "eagle" else "an EAGLE (EAGLE-1)"
        raise ValueError(f"{model} is {kind} checkpoint: method \"{'eagle3' if method == 'eagle' else 'eagle'}\"")
    if not issubclass(target.spec.model_cls, LlamaForCausalLM):
        raise ValueError("an EAGLE drafter reads a Llama-style target's hidden states (LlamaForCausalLM and the "
                         "families built on it)")
    hf = load_hf_config(source)
    target.wait_for_weights()
    head, embeddings = target_tables(target.state)
    if method == "eagle3":
        module, cfg = eagle3.Eagle3Llama, eagle3.Eagle3Config.for_target(hf, target.cfg, names, target.cfg.attention)
        shared = eagle3.shared_tables(cfg, names, head, embeddings)
        mapper = eagle3.map_eagle3_weight
    else:
        module = EagleLlama
        cfg = EagleConfig.for_target(hf, target.cfg, any(name.endswith("fc.bias") for name in names),
                                     target.cfg.attention)
        shared, mapper = {("embed_tokens",): embeddings, ("lm_head",): head}, map_eagle_weight
    layout = DrafterLayout.beside(target, cfg.num_heads, cfg.num_kv_heads, lambda name: split_rule(name, cfg))
    graphdef, state = load_drafter_state(source.directory, module, cfg, target.dtype, target.weight_dtype, mapper,
                                         shared, layout)
    cfg = cfg if layout is None else layout.config(cfg)
    return LoadedModel(
        name=source.name, source=source, hf_config=hf, cfg=cfg, spec=ModelSpec(sys.modules[module.__module__],
                                                                                type(cfg), module),
        graphdef=graphdef, state=state, tokenizer=target.tokenizer, eos_token_ids=target.eos_token_ids,
        max_position_embeddings=target.max_position_embeddings, dtype=target.dtype, weight_dtype=target.weight_dtype)
