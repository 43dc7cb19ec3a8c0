"""Where jaxserve keeps what it writes between runs: under `$JAXSERVE_CACHE_DIR`, by default `~/.cache/jaxserve`
(a GGUF's converted config and tokenizer under `gguf/`, XLA's persistent compilation cache under `xla/`), as
vLLM keeps its caches under `VLLM_CACHE_ROOT`."""

import os
from pathlib import Path


def cache_dir(kind: str) -> Path:
    """`$JAXSERVE_CACHE_DIR/<kind>`, by default `~/.cache/jaxserve/<kind>`."""
    return Path(os.environ.get("JAXSERVE_CACHE_DIR") or "~/.cache/jaxserve").expanduser() / kind
