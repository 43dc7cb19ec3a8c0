"""LoRA adapters for multi-LoRA serving (`--enable-lora`, `--lora-modules`): PEFT's adapter format read into
host arrays, and a loaded model given a stack of adapter slots in each dense projection (`layers.LoraStack`).

An adapter is read once, at start-up: A and B of each projection it targets, checked against the model's
shapes, transposed to the model's [in, out] layout, B scaled by alpha / r (rsLoRA: alpha / sqrt(r)). The
runner writes an adapter into a device slot when a request of it starts and the slot holds another
(`ModelRunner`); the scheduler decides which adapter holds which slot (`engine/lora_slots.py`).

A model family serves adapters where its module declares `LORA_TARGETS` (a target module's name within an
HF layer -> its stack's path within the model's layer) and, for fused projections, `LORA_FUSED_TARGETS`.
"""

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from jaxserve.models.layers import LoraSlots
from jaxserve.models.loader import LoadedModel
from jaxserve.parallel import replicated

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# A PEFT key: base_model.model.model.layers.{i}.{target}.lora_{A|B}[.{adapter}].weight
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(.+)\.lora_([AB])(?:\.\w+)?\.weight$")
# adapter_config.json settings that change what the weights mean and that jaxserve does not serve.
_UNSERVED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out weights", "lora_bias": "LoRA biases",
             "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)",
             "modules_to_save": "modules_to_save (full weights besides the adapter)"}

StackPath = tuple  # ("layers", layer, sub-module, stack), e.g. ("layers", 3, "self_attn", "q_lora")


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter as the runner writes it to a slot: per stack it fills, A f32[K, r] and B f32[r, N] with
    the scale in B. The stacks it does not target stay zero in its slot."""

    name: str
    rank: int
    weights: dict[StackPath, tuple[np.ndarray, np.ndarray]]


def stack_shapes(state: nnx.State) -> dict[StackPath, tuple[int, int]]:
    """Each LoRA stack of a model's state: (in, out) of the projection it adds to."""
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(state))
    return {path[:-1]: (int(leaf.shape[0]), int(flat[(*path[:-1], "lora_b")].shape[-1]))
            for path, leaf in flat.items() if path[-1] == "lora_a"}


def with_lora_slots(model: LoadedModel, slots: LoraSlots) -> LoadedModel:
    """The model with `slots` adapter slots in each dense projection, all zero (no adapter), beside its own
    weights (loaded first, where they load on a thread)."""
    family = model.spec.module
    if getattr(family, "LORA_TARGETS", None) is None or not hasattr(model.cfg, "lora"):
        raise ValueError(f"--enable-lora: not supported for {model.spec.model_cls.__name__}")
    if model.cfg.num_heads != model.hf_config.num_attention_heads:
        raise ValueError("--enable-lora: not with tensor parallelism that lays heads out again (the heads do not "
                         "divide evenly over the devices)")
    model.wait_for_weights()  # where they load on a thread
    cfg = dataclasses.replace(model.cfg, lora=slots)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: model.spec.model_cls(cfg, model.dtype, model.weight_dtype)))
    current = traverse_util.flatten_dict(nnx.to_pure_dict(model.state))
    placement = replicated(model.mesh) if model.mesh is not None else None
    flat = {path: current[path] if path in current else jnp.zeros(leaf.shape, leaf.dtype, device=placement)
            for path, leaf in traverse_util.flatten_dict(nnx.to_pure_dict(abstract)).items()}
    nnx.replace_by_pure_dict(abstract, traverse_util.unflatten_dict(flat))
    return dataclasses.replace(model, cfg=cfg, graphdef=graphdef, state=abstract)


def adapter_directory(path: str) -> Path:
    """A local PEFT directory as it is, or a hub id downloaded (what the user asked for: --lora-modules)."""
    directory = Path(path).expanduser()
    if directory.is_dir():
        return directory
    if directory.exists() or path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise ValueError(f"LoRA adapter path {path!r} is not a directory")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, allow_patterns=[ADAPTER_CONFIG, ADAPTER_WEIGHTS]))


def read_adapter(name: str, path: str, family: ModuleType, shapes: dict[StackPath, tuple[int, int]],
                 max_rank: int) -> LoraAdapter:
    """The PEFT adapter at `path` for a model of `family` whose stacks have `shapes`; raises ValueError,
    naming the adapter, for what cannot be served as the adapter means it."""
    directory = adapter_directory(path)
    try:
        config = json.loads((directory / ADAPTER_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {directory / ADAPTER_CONFIG}: {error}") from None
    for key, what in _UNSERVED.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {what} not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: trained biases (bias={config['bias']!r}) not supported")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: rank r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}")
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, tensor in _tensors(directory / ADAPTER_WEIGHTS, name):
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"LoRA adapter {name!r}: {key} is not a LoRA weight of a decoder layer's projection "
                             "(adapters of embeddings or the LM head are not supported)")
        parts.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    if not parts:
        raise ValueError(f"LoRA adapter {name!r}: no LoRA weights in {directory / ADAPTER_WEIGHTS}")
    weights: dict[StackPath, tuple[np.ndarray, np.ndarray]] = {}
    for (layer, target), pair in sorted(parts.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer}'s {target} has lora_{''.join(pair)} only")
        a, b = pair["A"], pair["B"]  # [r, in], [out, r] (HF Linear layout)
        stacks = _stacks(name, family, layer, target, shapes)
        outs = [shapes[stack][1] for stack in stacks]
        if a.shape != (rank, shapes[stacks[0]][0]) or b.shape != (sum(outs), rank):
            raise ValueError(f"LoRA adapter {name!r}: layer {layer}'s {target} has A {list(a.shape)} and B "
                             f"{list(b.shape)}, not [{rank}, {shapes[stacks[0]][0]}] and [{sum(outs)}, {rank}]")
        for stack, rows in zip(stacks, np.split(b, np.cumsum(outs)[:-1]), strict=True):
            weights[stack] = (np.ascontiguousarray(a.T), np.ascontiguousarray(rows.T) * np.float32(scale))
    return LoraAdapter(name, rank, weights)


def _stacks(name: str, family: ModuleType, layer: int, target: str,
            shapes: dict[StackPath, tuple[int, int]]) -> list[StackPath]:
    targets = getattr(family, "LORA_FUSED_TARGETS", {}).get(target, (target,))
    stacks = []
    for one in targets:
        where = family.LORA_TARGETS.get(one)
        stack = ("layers", layer, *where) if where is not None else None
        if stack not in shapes:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer}'s {target} is not a projection this model "
                             f"serves adapters for ({', '.join(family.LORA_TARGETS)}, in dense layers)")
        stacks.append(stack)
    return stacks


def _tensors(file: Path, name: str) -> list[tuple[str, np.ndarray]]:
    """The adapter's tensors, as float32 (safetensors' numpy side reads no bfloat16: through jax)."""
    from safetensors import safe_open

    if not file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no {file.name} in {file.parent} (PEFT's safetensors format)")
    with safe_open(str(file), framework="flax") as f:
        return [(key, np.asarray(jax.device_get(f.get_tensor(key)), np.float32)) for key in f.keys()]  # noqa: SIM118


def adapter_bytes(adapter: LoraAdapter) -> int:
    return sum(a.nbytes + b.nbytes for a, b in adapter.weights.values())


def slot_values(adapter: LoraAdapter | None, shapes: dict[StackPath, tuple[int, int]], rank: int,
                dtype: Any) -> dict[StackPath, tuple[np.ndarray, np.ndarray]]:
    """What a slot holds for `adapter` (None: no adapter, all zero): per stack, A [K, rank] and B [rank, N],
    the adapter's rank padded with zeros, in the stacks' dtype."""
    values = {}
    for stack, (d_in, d_out) in shapes.items():
        a, b = np.zeros((d_in, rank), dtype), np.zeros((rank, d_out), dtype)
        if adapter is not None and stack in adapter.weights:
            own_a, own_b = adapter.weights[stack]
            a[:, : own_a.shape[1]], b[: own_b.shape[0]] = own_a, own_b
        values[stack] = (a, b)
    return values
