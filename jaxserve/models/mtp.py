"""A model's own multi-token prediction (MTP) layer as its drafter (vLLM's "mtp" method; DeepSeek-V3's technical
report, section 2.2; GLM-4.5).

DeepSeek-V3 (and R1) and GLM-4.5 (and 4.6) checkpoints hold, after their `num_hidden_layers` layers, a module
trained to predict the token after next (`num_nextn_predict_layers`, one in every released model). At position
j it takes the embedding of the token at j + 1, RMS-normed (`enorm`), and the model's final hidden state at j
(after its last norm: the "feature"), normed (`hnorm`); `eh_proj` fuses them ([2D] -> [D]); one decoder layer of
the model's own kind (DeepSeek's latent attention, GLM-4.5's attention; both with their experts) runs over its
own K/V of the positions before; `shared_head`'s norm and the LM head predict the token at j + 2. As vLLM does,
the embedding at position 0 is zeroed. Its output before that norm stands in for the feature at j + 1 when it
runs ahead on its own drafts, as an EAGLE drafter's does, and it drafts through the same machinery
(`engine/eagle_proposer.py`, `models/features.py`): it reads its features from the last entry of its KV cache
and writes its output to the next position's slot.

The layer's weights are read from the model's own checkpoint (its tensors alone), or from a GGUF file's
`nextn` tensors and the block they go with (llama.cpp's names, dequantized to the weight dtype), through the
family's own weight stream and name map as a one-layer model of that family; the embeddings and the LM head are
the target's, not copied, unless the layer's own copies differ from them byte for byte.
"""

import dataclasses
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models import ModelSpec, deepseek, llama
from jaxserve.models.deepseek import DecoderLayer as DeepseekLayer
from jaxserve.models.deepseek import DeepseekConfig
from jaxserve.models.eagle import (
    DrafterLayout,
    checkpoint_names,
    drafter_caches,
    drafter_inputs,
    drafter_state,
    target_tables,
)
from jaxserve.models.gguf import iter_gguf_tensors
from jaxserve.models.kv_scales import checkpoint_kv_scale
from jaxserve.models.layers import (
    AttentionMetadata,
    KVCache,
    RMSNorm,
    apply_layers,
    dense,
    logits_from_embeddings,
    param,
)
from jaxserve.models.llama import DecoderLayer as LlamaLayer
from jaxserve.models.llama import LlamaConfig
from jaxserve.models.loader import LoadedModel, iter_safetensors, safetensors_header
from jaxserve.models.quantization import (
    Fp8Tensor,
    checkpoint_fp8_block,
    checkpoint_quantization,
    fp8_checkpoint_tensors,
)
from jaxserve.parallel import SplitRule


@dataclass(frozen=True)
class LlamaMtpConfig(LlamaConfig):
    """GLM-4.5's MTP layer: a one-layer GLM-4.5 (its experts as the model's last layer's)."""

    feature_width: int = 0  # the target's hidden size: each position's feature


@dataclass(frozen=True)
class DeepseekMtpConfig(DeepseekConfig):
    """DeepSeek-V3's MTP layer: a one-layer DeepSeek-V3 (its experts as the model's last layer's)."""

    feature_width: int = 0  # the target's hidden size: each position's feature


_LAYER_CLASSES: dict[type, type[nnx.Module]] = {LlamaMtpConfig: LlamaLayer, DeepseekMtpConfig: DeepseekLayer}


def mtp_config(target_cfg: Any) -> LlamaMtpConfig | DeepseekMtpConfig:
    """The MTP layer's config: the target's, as a one-layer model whose layer has experts where the target's
    layer L (its index) would, without LoRA stacks or a classifier; raises ValueError for a model without MTP
    layers."""
    count = getattr(target_cfg, "mtp_layers", 0)
    if not count:
        raise ValueError("the model has no multi-token prediction layers (num_nextn_predict_layers): method "
                         "\"mtp\" drafts with the layers that DeepSeek-V3 and GLM-4.5 checkpoints carry")
    if count > 1:
        raise ValueError(f"the model has {count} multi-token prediction layers, and drafting with one each step "
                         "(as vLLM does) is not served yet: one is")
    if isinstance(target_cfg, DeepseekConfig):
        fields = {field.name: getattr(target_cfg, field.name) for field in dataclasses.fields(DeepseekConfig)}
        sparse = target_cfg.num_layers >= target_cfg.first_dense_layers
        return DeepseekMtpConfig(**fields | {"num_layers": 1, "first_dense_layers": 0 if sparse else 1,
                                             "mtp_layers": 0}, feature_width=target_cfg.hidden_size)
    per_layer = ("sliding_windows", "rope_layers", "layer_ropes")
    if not isinstance(target_cfg, LlamaConfig) or any(getattr(target_cfg, name) for name in per_layer):
        raise ValueError("multi-token prediction layers are served for DeepSeek-V3 and GLM-4.5 (models of one "
                         "kind of layer), not for this model")
    fields = {field.name: getattr(target_cfg, field.name) for field in dataclasses.fields(LlamaConfig)}
    sparse = any(target_cfg.moe_layers)  # GLM-4.5's: experts from its first sparse layer on
    return LlamaMtpConfig(**fields | {"num_layers": 1, "moe_layers": (sparse,), "mtp_layers": 0, "lora": None,
                                      "classifier": None}, feature_width=target_cfg.hidden_size)


class MtpDrafter(nnx.Module):
    """The MTP layer: `__call__` as a model's, over a KV cache whose last entry holds its features."""

    reads_features = True

    def __init__(self, cfg: LlamaMtpConfig | DeepseekMtpConfig, dtype: Any, weight_dtype: Any = None) -> None:
        weight_dtype = weight_dtype or dtype
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = param(cfg.vocab_size, d, dtype=weight_dtype)  # the target's, or the layer's own
        self.enorm = RMSNorm(d, eps, dtype)
        self.hnorm = RMSNorm(d, eps, dtype)
        self.eh_proj = param(2 * d, d, dtype=weight_dtype)  # [enorm(embedding) ; hnorm(feature)] -> D
        self.layers = nnx.List([_LAYER_CLASSES[type(cfg)](cfg, dtype, weight_dtype, 0)])
        self.shared_head_norm = RMSNorm(d, eps, dtype)
        self.lm_head = param(cfg.vocab_size, d, dtype=weight_dtype)  # the target's, or the layer's own

    def __call__(
        self,
        input_ids: jax.Array,  # i32[T]: the token at each position's next one
        positions: jax.Array,  # i32[T]
        kv_caches: KVCache,  # the layer's K/V, then (features [1, pages, page_size, D], None)
        md: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:  # [T, D]
        attention = self.cfg.attention
        embedded, fed, features, layer_caches = drafter_inputs(self.embed_tokens[...], input_ids, kv_caches, md,
                                                               attention, self.dtype)
        embedded = jnp.where((positions == 0)[:, None], 0, embedded)  # as vLLM's: unused at position 0
        x = dense(jnp.concatenate([self.enorm(embedded), self.hnorm(fed)], axis=-1), self.eh_proj[...], attention)
        x, layer_caches = apply_layers(self.layers, x, layer_caches, positions=positions, md=md)
        return x, drafter_caches(layer_caches, features, x, positions, md)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [R, D] -> f32[R, V]
        return logits_from_embeddings(self.shared_head_norm(hidden), self.lm_head[...], self.cfg.attention)


def checkpoint_heads(cfg: LlamaMtpConfig | DeepseekMtpConfig, own_heads: Any) -> LlamaMtpConfig | DeepseekMtpConfig:
    """The MTP layer's config `cfg` (the target's, heads laid out for its mesh) with the heads its checkpoint's
    tensors hold (`own_heads`: the target's config as its checkpoint has it)."""
    return dataclasses.replace(cfg, num_heads=own_heads.num_heads, num_kv_heads=own_heads.num_kv_heads)


def split_rule(name: str, cfg: LlamaMtpConfig | DeepseekMtpConfig) -> SplitRule:
    """How the MTP layer's parameter `name` splits over a mesh: `eh_proj` whole on every device, the rest as
    its family's."""
    if name == "eh_proj":
        return None, None
    return deepseek.split_rule(name, cfg) if isinstance(cfg, DeepseekMtpConfig) else llama.split_rule(name, cfg)


# The MTP layer's own tensors, by their names after `model.layers.{L}.` -> their paths in `MtpDrafter`; its
# other tensors are its decoder layer's.
_OWN = {"enorm.weight": ("enorm", "scale"), "hnorm.weight": ("hnorm", "scale"), "eh_proj.weight": ("eh_proj",),
        "shared_head.norm.weight": ("shared_head_norm", "scale")}
_TABLES = {"embed_tokens.weight": ("embed_tokens",), "shared_head.head.weight": ("lm_head",)}  # [V, D] each


def _same_tensor(directory: Path, first: str, second: str) -> bool:
    """Whether two tensors of a checkpoint have the same dtype, shape and bytes, compared in their files (mapped,
    not loaded)."""
    found: dict[str, tuple[str, dict]] = {}
    for file in sorted(directory.glob("*.safetensors")):
        header = safetensors_header(str(file))
        found |= {name: (str(file), header[name]) for name in (first, second) if name in header}
    if len(found) < 2 or any(found[first][1][key] != found[second][1][key] for key in ("dtype", "shape")):
        return False

    def data(name: str) -> np.ndarray:
        file, entry = found[name]
        begin, end = (entry["start"] + offset for offset in entry["data_offsets"])
        return np.memmap(file, dtype=np.uint8, mode="r", offset=begin, shape=(end - begin,))

    return bool(np.array_equal(data(first), data(second)))


def load_mtp(target: LoadedModel) -> LoadedModel:
    """The MTP layer of `target` (loaded, from a safetensors checkpoint or a GGUF file, whose layer is
    dequantized) as a drafter beside it, in its dtypes and attention, split over its devices as its layers are;
    raises ValueError where it has none or it cannot be read."""
    cfg = mtp_config(target.cfg)  # its heads laid out as the target's are, over the target's mesh
    own_heads = target.spec.config_cls.from_hf(target.hf_config)  # the checkpoint's heads, as its tensors hold them
    checkpoint_cfg = checkpoint_heads(cfg, own_heads)
    layout = DrafterLayout.beside(target, own_heads.num_heads, own_heads.num_kv_heads,
                                  lambda name: split_rule(name, cfg))
    laid_out = checkpoint_cfg if layout is None else layout.config(checkpoint_cfg)
    if (laid_out.num_heads, laid_out.num_kv_heads) != (cfg.num_heads, cfg.num_kv_heads):  # as the target's heads
        raise ValueError(f"the MTP layer's heads laid out as {laid_out.num_heads} and {laid_out.num_kv_heads}, the "
                         f"model's as {cfg.num_heads} and {cfg.num_kv_heads}")
    source, prefix = target.source, f"model.layers.{target.cfg.num_layers}."
    if source.gguf_file:  # llama.cpp's `nextn` tensors; its copies of the tables only where they are not the model's
        tensors = iter_gguf_tensors(str(source.directory / source.gguf_file), own_heads.num_heads,
                                    own_heads.num_kv_heads, prediction=True)
        own_tables, fp8, fp8_block = set(_TABLES), False, None
    else:
        tensors, own_tables = _safetensors_layer(source.directory, prefix, target.cfg.tie_word_embeddings)
        fp8 = checkpoint_quantization(target.hf_config) == "fp8"  # None or "fp8" (it raises for what it cannot read)
        fp8_block = checkpoint_fp8_block(target.hf_config)
    target.wait_for_weights()
    head, embeddings = target_tables(target.state)
    shared = {("embed_tokens",): embeddings, ("lm_head",): head}  # where the layer's own tables do not replace them
    weights = _layer_weights(tensors, target.spec.module, prefix, checkpoint_cfg, fp8, fp8_block, own_tables)
    graphdef, state = drafter_state(MtpDrafter, checkpoint_cfg, target.dtype, target.weight_dtype, weights, shared,
                                    layout)
    return LoadedModel(
        name=f"{target.name} (MTP layer)", source=target.source, hf_config=target.hf_config, cfg=cfg,
        spec=ModelSpec(sys.modules[__name__], type(cfg), MtpDrafter), graphdef=graphdef, state=state,
        tokenizer=target.tokenizer, eos_token_ids=target.eos_token_ids,
        max_position_embeddings=target.max_position_embeddings, dtype=target.dtype, weight_dtype=target.weight_dtype)


def _safetensors_layer(directory: Path, prefix: str, tied: bool) -> tuple[Iterator[tuple[str, Any]], set[str]]:
    """The checkpoint's tensors under `prefix` (the MTP layer's), as they stream from its files, and which of
    its tables are its own (present, and not byte for byte the model's); raises ValueError where the layer's
    pieces are not all there."""
    names = {name.removeprefix(prefix) for name in checkpoint_names(directory) if name.startswith(prefix)}
    if missing := sorted(_OWN.keys() - names):
        raise ValueError(f"the checkpoint has no multi-token prediction layer: {prefix}{missing[0]} is missing")
    model_tables = {"embed_tokens.weight": "model.embed_tokens.weight",
                    "shared_head.head.weight": "model.embed_tokens.weight" if tied else "lm_head.weight"}
    own_tables = {rest for rest in _TABLES.keys() & names
                  if not _same_tensor(directory, prefix + rest, model_tables[rest])}
    return iter_safetensors(directory, lambda name: name.startswith(prefix)), own_tables


def _layer_weights(tensors: Iterator[tuple[str, Any]], module: Any, prefix: str, cfg: Any, fp8: bool,
                   fp8_block: tuple[int, int] | None, own_tables: set[str]) -> Iterator[tuple[str, tuple, Any]]:
    """The MTP layer's weights (checkpoint name, path, value) from its tensors (`tensors`, named under
    `prefix`): its decoder layer's through the family's (`module`'s) weight stream and name map as layer 0 of a
    one-layer model of config `cfg`, FP8 ones (`fp8`, scales per block of `fp8_block` where given)
    dequantized; its tables only where `own_tables` names them."""
    tensors = ((f"model.layers.0.{name.removeprefix(prefix)}", tensor) for name, tensor in tensors)
    if fp8:
        tensors = fp8_checkpoint_tensors(tensors, fp8_block)
    if (stream := getattr(module, "hf_weight_stream", None)) is not None:
        tensors = stream(tensors, cfg)
    for name, tensor in tensors:
        if checkpoint_kv_scale(name) is not None:  # an FP8 cache's scales: the drafter's cache is never FP8
            continue
        value = tensor.dequantize() if isinstance(tensor, Fp8Tensor) else tensor
        rest = name.removeprefix("model.layers.0.")
        if rest in _OWN:
            yield prefix + rest, _OWN[rest], np.asarray(value).T if rest == "eh_proj.weight" else value
        elif rest in _TABLES:
            if rest in own_tables:
                yield prefix + rest, _TABLES[rest], value
        elif (mapped := module.map_hf_weight(name, cfg)) is not None:  # None: unused, as the model loads it
            path, transform = mapped
            if path[:2] != ("layers", 0):
                raise ValueError(f"the multi-token prediction layer's {prefix}{rest} is not one jaxserve reads")
            yield prefix + rest, path, transform(value, cfg)
