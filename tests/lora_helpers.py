"""LoRA test adapters: random PEFT adapters for a tiny model directory, and the model with an adapter merged
into its weights (W + scale * B A), the reference an adapter's outputs must match."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

_PROJECTION = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight$")


def write_adapter(directory: Path, base_dir: Path, targets: tuple[str, ...], rank: int = 4, alpha: float = 8.0,
                  seed: int = 0, rslora: bool = False, std: float = 0.3) -> Path:
    """A PEFT adapter for the model in `base_dir` with random A and B (PEFT starts B at zero) on `targets`."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, weight in sorted(load_file(base_dir / "model.safetensors").items()):
        match = _PROJECTION.match(name)
        if match is None or match.group(3) not in targets:
            continue
        out_dim, in_dim = weight.shape
        stem = f"base_model.model.{name.removesuffix('.weight')}"
        tensors[f"{stem}.lora_A.weight"] = rng.normal(0, std, (rank, in_dim)).astype(np.float32)
        tensors[f"{stem}.lora_B.weight"] = rng.normal(0, std, (out_dim, rank)).astype(np.float32)
    save_file(tensors, directory / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
              "use_rslora": rslora, "bias": "none", "base_model_name_or_path": str(base_dir)}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def write_merged(directory: Path, base_dir: Path, adapter_dir: Path) -> Path:
    """The base model with the adapter merged into its weights, in a directory of its own."""
    shutil.copytree(base_dir, directory, dirs_exist_ok=True)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    rank = config["r"]
    scale = config["lora_alpha"] / (rank ** 0.5 if config.get("use_rslora") else rank)
    weights = load_file(base_dir / "model.safetensors")
    adapter = load_file(adapter_dir / "adapter_model.safetensors")
    for name in weights:
        stem = f"base_model.model.{name.removesuffix('.weight')}"
        if f"{stem}.lora_A.weight" in adapter:
            a, b = adapter[f"{stem}.lora_A.weight"], adapter[f"{stem}.lora_B.weight"]
            weights[name] = (weights[name].astype(np.float64) + scale * (b.astype(np.float64) @ a)).astype(
                weights[name].dtype)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory
