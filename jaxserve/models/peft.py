"""PEFT's LoRA adapters read for serving (jax-free: the engine's frontend reads them, and sends them to the
core as numpy arrays): each projection's A and B, checked against the model's `LoraLayout`, transposed to
the model's [in, out] layout, B scaled by alpha / r (rsLoRA: alpha / sqrt(r)).

A model family serves adapters where its module declares `LORA_TARGETS` (a target module's name within an
HF layer -> its stack's path within the model's layer) and, for fused projections, `LORA_FUSED_TARGETS`;
`models/lora.py` gives a loaded model its adapter slots and describes them in a `LoraLayout`.
"""

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# A PEFT key: base_model.model.model.layers.{i}.{target}.lora_{A|B}[.{adapter}].weight
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(.+)\.lora_([AB])(?:\.\w+)?\.weight$")
# adapter_config.json settings that change what the weights mean and that jaxserve does not serve.
_UNSERVED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out weights", "lora_bias": "LoRA biases",
             "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)",
             "modules_to_save": "modules_to_save (full weights besides the adapter)"}

StackPath = tuple  # ("layers", layer, sub-module, "lora", stack), e.g. ("layers", 3, "self_attn", "lora", "q")


@dataclass(frozen=True)
class LoraLayout:
    """What an adapter must fit: the model's LoRA stacks, (in, out) of the projection each adds to; the
    family's target names (`LORA_TARGETS`, `LORA_FUSED_TARGETS`); the slots' rank (--max-lora-rank); the
    targets whose output rows the model reorders at load, and their order (GLM-4's q and k)."""

    stacks: dict[StackPath, tuple[int, int]]
    targets: dict[str, tuple[str, ...]]
    fused_targets: dict[str, tuple[str, ...]]
    max_rank: int
    row_orders: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter as the runner writes it to a slot: per stack it fills, A f32[K, r] and B f32[r, N] with
    the scale in B. The stacks it does not target stay zero in its slot."""

    name: str
    rank: int
    weights: dict[StackPath, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def is_local_directory(path: str) -> bool:
    """Whether `path` names a directory here; False for any path the OS refuses (too long, say)."""
    try:
        return Path(path).expanduser().is_dir()
    except (OSError, ValueError):
        return False


def adapter_directory(path: str) -> Path:
    """A local PEFT directory as it is, or a hub id downloaded (what the user asked for: --lora-modules)."""
    if is_local_directory(path):
        return Path(path).expanduser()
    if path.startswith((".", "/", "~")) or path.count("/") != 1 or len(path) > 200 or Path(path).exists():
        raise ValueError(f"LoRA adapter path {path!r} is not a directory")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, allow_patterns=[ADAPTER_CONFIG, ADAPTER_WEIGHTS]))


def check_adapter_source(name: str, path: str) -> None:
    """That --lora-modules' `path` is a directory (or a hub id, downloaded) holding a PEFT adapter config,
    before the model loads; `read_adapter` checks its contents once the model's layout is known."""
    directory = adapter_directory(path)
    if not (directory / ADAPTER_CONFIG).is_file():
        raise ValueError(f"LoRA adapter {name!r}: no {ADAPTER_CONFIG} in {directory}")


def read_adapter(name: str, path: str, layout: LoraLayout) -> LoraAdapter:
    """The PEFT adapter at `path` for a model of `layout`; raises ValueError, naming the adapter, for what
    cannot be served as the adapter means it."""
    shapes, max_rank = layout.stacks, layout.max_rank
    directory = adapter_directory(path)
    try:
        config = json.loads((directory / ADAPTER_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {directory / ADAPTER_CONFIG}: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {ADAPTER_CONFIG} is not a JSON object")
    for key, what in _UNSERVED.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {what} not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: trained biases (bias={config['bias']!r}) not supported")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: rank r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise ValueError(f"LoRA adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, tensor in _tensors(directory / ADAPTER_WEIGHTS, name):
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"LoRA adapter {name!r}: {key} is not a LoRA weight of a decoder layer's projection "
                             "(adapters of embeddings or the LM head are not supported)")
        if not np.isfinite(tensor).all():  # one slot's inf would reach every token through the masked product
            raise ValueError(f"LoRA adapter {name!r}: {key} has values that are not finite")
        parts.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    if not parts:
        raise ValueError(f"LoRA adapter {name!r}: no LoRA weights in {directory / ADAPTER_WEIGHTS}")
    weights: dict[StackPath, tuple[np.ndarray, np.ndarray]] = {}
    for (layer, target), pair in sorted(parts.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer}'s {target} has lora_{''.join(pair)} only")
        a, b = pair["A"], pair["B"]  # [r, in], [out, r] (HF Linear layout)
        stacks = _stacks(name, layout, layer, target)
        outs = [shapes[stack][1] for stack in stacks]
        if a.shape != (rank, shapes[stacks[0]][0]) or b.shape != (sum(outs), rank):
            raise ValueError(f"LoRA adapter {name!r}: layer {layer}'s {target} has A {list(a.shape)} and B "
                             f"{list(b.shape)}, not [{rank}, {shapes[stacks[0]][0]}] and [{sum(outs)}, {rank}]")
        for one, stack, rows in zip(_targets(layout, target), stacks, np.split(b, np.cumsum(outs)[:-1]), strict=True):
            if (order := layout.row_orders.get(one)) is not None:
                rows = rows[order]
            weights[stack] = (np.ascontiguousarray(a.T), np.ascontiguousarray(rows.T) * np.float32(scale))
    return LoraAdapter(name, rank, weights)


def _targets(layout: LoraLayout, target: str) -> tuple[str, ...]:
    """The targets a PEFT target fills: itself, or a fused one's parts."""
    return layout.fused_targets.get(target, (target,))


def _stacks(name: str, layout: LoraLayout, layer: int, target: str) -> list[StackPath]:
    stacks = []
    for one in _targets(layout, target):
        where = layout.targets.get(one)
        stack = ("layers", layer, *where) if where is not None else None
        if stack not in layout.stacks:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer}'s {target} is not a projection this model "
                             f"serves adapters for ({', '.join(layout.targets)}, in dense layers)")
        stacks.append(stack)
    return stacks


def _tensors(file: Path, name: str) -> list[tuple[str, np.ndarray]]:
    """The adapter's tensors as float32, read from the file's header and bytes (numpy's safetensors reader
    has no bfloat16: its top 16 bits of a float32)."""
    if not file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no {file.name} in {file.parent} (PEFT's safetensors format)")
    try:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + size)
        tensors = []
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            raw = np.asarray(data[begin:end])
            if entry["dtype"] == "BF16":
                values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            elif entry["dtype"] in _FLOATS:
                values = raw.view(_FLOATS[entry["dtype"]]).astype(np.float32)
            else:
                raise ValueError(f"tensor {key} is {entry['dtype']}, not a float")
            tensors.append((key, values.reshape(entry["shape"])))
    except (OSError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {file}: {error}") from None
    return tensors


_FLOATS = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8")}


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
