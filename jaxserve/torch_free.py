"""Serving without PyTorch in the process, where PyTorch is installed.

transformers imports torch whenever it is installed, and with it torch.distributed, FSDP and transformers'
masking and generation code: 9.3 of a server's 11.5 s of imports on a GPU machine whose image has PyTorch
(docs/benchmarks.md), though a server reads only configs, tokenizers and chat templates through
transformers. Hiding torch before transformers is first imported makes transformers take its torch-free
paths. The one serving path that needs torch keeps it: transformers' GGUF reader, for a GGUF whose config
and tokenizer are not converted yet (models/gguf_cache.py).
"""

import os
import sys
from pathlib import Path


def keep_torch_out(model: str | None) -> bool:
    """Hides torch from this process (`import torch` raises ImportError, and `importlib.util.find_spec`,
    which transformers asks, finds nothing) unless torch or transformers is imported already or `model`
    (`--model`) is a GGUF file still to be converted; returns whether it did."""
    if "torch" in sys.modules or "transformers" in sys.modules or _gguf_to_convert(model):
        return False  # transformers decides once, at its import, whether torch is there
    sys.modules["torch"] = None  # the import system's mark for a module that must not be imported
    # transformers' advice that PyTorch was not found ("models won't be available"), at every start: the
    # models are jaxserve's own
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    return True


def _gguf_to_convert(model: str | None) -> bool:
    if model is None or (path := Path(model).expanduser()).suffix != ".gguf" or not path.is_file():
        return False
    from jaxserve.models.gguf_cache import is_converted

    try:
        return not is_converted(path)
    except OSError:  # unreadable: the loader says so in one line; torch stays as it was
        return True
