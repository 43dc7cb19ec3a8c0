"""Multi-LoRA serving's model side (`--enable-lora`): a loaded model given a stack of adapter slots in each
dense projection (`layers.LoraStack`), and the `LoraLayout` adapters are read against (`peft.py`). The
runner writes an adapter into a device slot when a request of it starts and the slot holds another
(`ModelRunner`); the scheduler decides which adapter holds which slot (`engine/lora_slots.py`).
"""

import dataclasses
from typing import Any

import jax.numpy as jnp
from flax import nnx, traverse_util

from jaxserve.models.layers import LoraShape
from jaxserve.models.loader import AbstractModel, LoadedModel
from jaxserve.models.peft import LoraLayout, StackPath
from jaxserve.parallel import replicated


def stack_shapes(state: nnx.State) -> dict[StackPath, tuple[int, int]]:
    """Each LoRA stack of a model's state: (in, out) of the projection it adds to."""
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(state))
    return {path[:-1]: (int(leaf.shape[0]), int(flat[(*path[:-1], "lora_b")].shape[-1]))
            for path, leaf in flat.items() if path[-1] == "lora_a"}


def with_lora_slots(model: LoadedModel, shape: LoraShape) -> LoadedModel:
    """The model with `shape.max_loras` adapter slots in each dense projection, all zero (no adapter), beside
    its own weights (loaded first, where they load on a thread)."""
    family = model.spec.module
    if getattr(family, "LORA_TARGETS", None) is None or not hasattr(model.cfg, "lora"):
        raise ValueError(f"--enable-lora: not supported for {model.spec.model_cls.__name__}")
    hf = model.hf_config
    if (model.cfg.num_heads, model.cfg.num_kv_heads) != (
            hf.num_attention_heads, getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads):
        raise ValueError("--enable-lora: not with tensor parallelism that lays heads out again (the heads do not "
                         "divide evenly over the devices)")
    model.wait_for_weights()  # where they load on a thread
    cfg = dataclasses.replace(model.cfg, lora=shape)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: model.spec.model_cls(cfg, model.dtype, model.weight_dtype)))
    current = traverse_util.flatten_dict(nnx.to_pure_dict(model.state))
    placement = replicated(model.mesh) if model.mesh is not None else None
    flat = {path: current[path] if path in current else jnp.zeros(leaf.shape, leaf.dtype, device=placement)
            for path, leaf in traverse_util.flatten_dict(nnx.to_pure_dict(abstract)).items()}
    nnx.replace_by_pure_dict(abstract, traverse_util.unflatten_dict(flat))
    return dataclasses.replace(model, cfg=cfg, graphdef=graphdef, state=abstract)


def abstract_with_lora(abstract: AbstractModel, shape: LoraShape, dtype: Any, weight_dtype: Any = None
                       ) -> AbstractModel:
    """A model built from its config alone, with `shape`'s adapter slots: what a compile of a LoRA server's
    step needs (`jaxserve compile --max-loras`)."""
    if getattr(abstract.spec.module, "LORA_TARGETS", None) is None or not hasattr(abstract.cfg, "lora"):
        raise ValueError(f"--enable-lora: not supported for {abstract.spec.model_cls.__name__}")
    cfg = dataclasses.replace(abstract.cfg, lora=shape)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: abstract.spec.model_cls(cfg, dtype, weight_dtype)))
    return dataclasses.replace(abstract, cfg=cfg, graphdef=graphdef, state=state)


def lora_layout(model: LoadedModel) -> LoraLayout:
    """What adapters for `model` (given its slots) must fit."""
    family = model.spec.module
    fused = dict(getattr(family, "LORA_FUSED_TARGETS", {}))
    row_orders = family.lora_row_orders(model.cfg) if hasattr(family, "lora_row_orders") else {}
    return LoraLayout(stack_shapes(model.state), dict(family.LORA_TARGETS), fused, model.cfg.lora.max_rank,
                      row_orders)
