"""A GGUF file's config and tokenizer, converted once and kept as an HF directory keyed by the file's hash.

transformers reads both from GGUF metadata by parsing the whole file, which took about 7 s (config) and
5 s (tokenizer) of every start for the bundled 98 MB SmolLM2; reading the converted `config.json` and
`tokenizer.json` takes milliseconds. The key is the file's SHA-256, so a changed file converts anew, and
the directory appears whole or not at all (written aside, then renamed), so concurrent starts are safe.
Weights are still read from the GGUF itself (memory-mapped, about a second).
"""

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

_CONVERTED_FILES = ("config.json", "tokenizer_config.json")
_FORMAT = "1"  # bump when what is written here changes


def cache_root() -> Path:
    """`$JAXSERVE_CACHE_DIR/gguf`, by default `~/.cache/jaxserve/gguf`."""
    base = os.environ.get("JAXSERVE_CACHE_DIR") or "~/.cache/jaxserve"
    return Path(base).expanduser() / "gguf"


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def converted_dir(gguf_path: Path) -> Path:
    """The HF directory holding `gguf_path`'s config and tokenizer, converting them on first use."""
    target = cache_root() / f"{file_sha256(gguf_path)}-v{_FORMAT}"
    if all((target / name).is_file() for name in _CONVERTED_FILES):
        return target
    from transformers import AutoConfig, AutoTokenizer

    logger.info("converting %s's config and tokenizer once (cached in %s)", gguf_path.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        kwargs = {"gguf_file": gguf_path.name}
        AutoConfig.from_pretrained(str(gguf_path.parent), **kwargs).save_pretrained(staging)
        AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs).save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process got there first (or a partial directory is in the way)
            if not all((target / name).is_file() for name in _CONVERTED_FILES):
                shutil.rmtree(target, ignore_errors=True)
                staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
