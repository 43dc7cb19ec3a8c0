"""What a sentence-transformers model directory says of its pooling (no jax): the pooling its `Pooling` module
does (`modules.json`, then that module's `config.json`: `1_Pooling/config.json` in most) and the longest input
it reads (`sentence_bert_config.json`'s `max_seq_length`), as vLLM reads them for `--runner pooling`.
"""

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_POOLING_MODULE = "sentence_transformers.models.Pooling"
# Modules a pooled vector passes through that jaxserve does as sentence-transformers does (the API normalizes)
_APPLIED = ("sentence_transformers.models.Transformer", _POOLING_MODULE, "sentence_transformers.models.Normalize")
# The Pooling module's modes jaxserve pools by, in the order sentence-transformers concatenates them
_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def pooling_type(directory: Path) -> str | None:
    """The model's sentence-transformers pooling ("cls", "mean" or "last"); None where it has none, or one
    jaxserve does not pool by (max, weighted mean, several concatenated: said in the log)."""
    modules = _read_json(directory / "modules.json")
    modules = [module for module in modules if isinstance(module, dict)] if isinstance(modules, list) else None
    if others := sorted({str(m.get("type")) for m in modules or () if m.get("type") not in _APPLIED}):
        logger.warning("the model's sentence-transformers modules %s are not applied: its vectors are the pooled "
                       "hidden states, not what sentence-transformers gives", ", ".join(others))
    paths = [m.get("path", "") for m in modules if m.get("type") == _POOLING_MODULE] if modules is not None \
        else ["1_Pooling"]
    settings = next((found for path in paths if isinstance(found := _read_json(directory / path / "config.json"),
                                                           dict)), None)
    if settings is None:
        return None
    modes = [mode for key, mode in _MODES.items() if settings.get(key)]
    others = [key for key, on in settings.items() if key.startswith("pooling_mode") and on and key not in _MODES]
    if len(modes) != 1 or others:
        logger.warning("the model's sentence-transformers pooling (%s) is not one jaxserve pools by (cls, mean, "
                       "last): --pooling-type auto takes the model's default",
                       ", ".join(key for key, on in settings.items() if key.startswith("pooling_mode") and on))
        return None
    return modes[0]


def max_seq_length(directory: Path) -> int | None:
    """The longest input the sentence-transformers model reads (its `max_seq_length`); None where it says none."""
    settings = _read_json(directory / "sentence_bert_config.json")
    length = settings.get("max_seq_length") if isinstance(settings, dict) else None
    return length if isinstance(length, int) and length > 0 else None
