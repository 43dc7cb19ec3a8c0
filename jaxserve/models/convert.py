"""`jaxserve convert`: load a model as serve would, and write it as an orbax checkpoint (models/checkpoint.py)."""

from pathlib import Path

from jaxserve.config import ModelConfig
from jaxserve.models.checkpoint import save_checkpoint
from jaxserve.models.loader import load_model, metadata_dir


def main(config: ModelConfig, output_dir: Path) -> Path:
    """Loads `config.model` in its dtypes and writes it to `output_dir`; returns the checkpoint's directory."""
    model = load_model(config.model, config.dtype, revision=config.revision, weight_dtype=config.weight_dtype,
                       download_dir=config.download_dir)
    out = save_checkpoint(model, metadata_dir(model.source), output_dir)
    print(f"wrote {model.name} ({model.dtype.__name__}, weights {model.weight_dtype.__name__}) as an orbax "
          f"checkpoint to {out}; serve it with: jaxserve serve --model {out}")
    return out
