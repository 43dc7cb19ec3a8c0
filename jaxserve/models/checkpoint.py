"""Converted weights as an orbax checkpoint: `jaxserve convert` writes one, `--model DIR` restores it.

A converted directory is a Hugging Face model directory without safetensors:

    DIR/config.json, tokenizer files, generation_config.json (when the source had one)
    DIR/jaxserve-checkpoint.json   what wrote it: format version, source model, dtype, weight dtype
    DIR/weights/                   orbax: the model's parameters as a nested dict, in the model's own
                                   layout (checkpoint heads, no mesh layout), each in its converted dtype

A restore casts each parameter to the dtype the serving flags give it (`--dtype`, `--weight-dtype`).

Restoring reads each array straight into its target sharding, so each device (and each process of a
multi-host run) reads only the shards it keeps. When tensor parallelism rearranges the heads
(`jaxserve.parallel.HeadLayout`: replicated KV heads or padded query heads), the stored arrays no longer
have the target's shapes: they come whole to the first device, are laid out on the host, and go to
their shards.
"""

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxserve.parallel import on_one_device

logger = logging.getLogger(__name__)

MARKER = "jaxserve-checkpoint.json"
FORMAT_VERSION = 1


def is_checkpoint(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def save_checkpoint(model: Any, metadata_dir: Path, output_dir: Path) -> Path:
    """Writes `model` (a `LoadedModel` on one device) to `output_dir`; returns the directory."""
    import orbax.checkpoint as ocp

    output_dir = output_dir.expanduser().resolve()
    if output_dir.exists() and any(output_dir.iterdir()):
        raise FileExistsError(f"{output_dir} exists and is not empty")
    if model.mesh is not None:
        raise ValueError("convert from a model loaded on one device")
    output_dir.mkdir(parents=True, exist_ok=True)
    model.hf_config.save_pretrained(output_dir)
    model.tokenizer.save_pretrained(output_dir)
    if (metadata_dir / "generation_config.json").is_file():
        shutil.copy(metadata_dir / "generation_config.json", output_dir)
    weights = nnx.to_pure_dict(model.state)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(output_dir / "weights", weights)
    (output_dir / MARKER).write_text(json.dumps({
        "format": FORMAT_VERSION, "source": model.name, "dtype": np.dtype(model.dtype).name,
        "weight_dtype": np.dtype(model.weight_dtype).name,
        "eos_token_ids": list(model.eos_token_ids),
    }, indent=2) + "\n")
    return output_dir


def restore_weights(directory: Path, abstract: Any) -> dict:
    """The parameters as a nested dict of arrays on their devices (`abstract`: the loader's AbstractModel),
    each cast to its parameter's dtype on the way."""
    import orbax.checkpoint as ocp

    info = json.loads((directory / MARKER).read_text())
    if info.get("format") != FORMAT_VERSION:
        raise ValueError(f"{directory}: checkpoint format {info.get('format')} is not {FORMAT_VERSION}; "
                         "convert the model again with this jaxserve")
    _warn_if_widened(info, abstract)
    start = time.perf_counter()
    first_device = jax.devices()[0] if abstract.mesh is None else abstract.mesh.devices.flat[0]
    one_device = on_one_device(first_device)
    direct = abstract.heads.is_identity
    pure = nnx.to_pure_dict(abstract.state)
    if direct:  # the stored shapes are the target's: each shard is read where it lives
        target = _map_with_path(lambda path, leaf: jax.ShapeDtypeStruct(
            leaf.shape, leaf.dtype, sharding=abstract.sharding(path, leaf.shape) or one_device), pure)
    else:  # stored with the checkpoint's heads: read whole, then laid out
        dtypes = jax.tree.map(lambda leaf: leaf.dtype, pure)  # this model's; the shapes are the checkpoint's
        checkpoint_state = nnx.state(nnx.eval_shape(
            lambda: abstract.spec.model_cls(abstract.checkpoint_cfg, np.float32)))
        target = jax.tree.map(lambda leaf, dtype: jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=one_device),
                              nnx.to_pure_dict(checkpoint_state), dtypes)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(directory / "weights", target)
    if not direct:
        restored = _map_with_path(lambda path, value, leaf: jax.device_put(
            np.asarray(abstract.lay_out(path, np.asarray(value))).astype(leaf.dtype),
            abstract.sharding(path, leaf.shape)), restored, pure)
    logger.info("weights: restored from the orbax checkpoint in %.1fs", time.perf_counter() - start)
    return restored


def _warn_if_widened(info: dict, abstract: Any) -> None:
    """A checkpoint converted with narrower weights than this model asks for is widened on restore: the
    flags decide the dtypes, and the user is told what it costs."""
    stored = info.get("weight_dtype", info.get("dtype"))
    wanted = {np.dtype(leaf.dtype) for leaf in jax.tree.leaves(abstract.state)}
    if stored is not None and all(np.dtype(stored).itemsize < dtype.itemsize for dtype in wanted):
        logger.warning("the checkpoint stores its weights in %s; they are restored in %s, which takes more "
                       "memory (pass --weight-dtype %s to keep them as stored)",
                       stored, ", ".join(sorted(d.name for d in wanted)), stored)


def _map_with_path(fn: Any, tree: dict, *rest: dict) -> dict:
    """`jax.tree.map` over nested parameter dicts, `fn` also given the leaf's path of keys."""
    return jax.tree_util.tree_map_with_path(
        lambda keys, *leaves: fn(tuple(k.key for k in keys), *leaves), tree, *rest)
