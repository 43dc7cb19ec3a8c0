"""The step's temp memory as a start's KV sizing found it, kept beside JAX's persistent compilation cache,
so that a warm start sizes its cache without the quick compiles (no jax).

A GPU start sizes its KV cache from the largest buckets' temp memory, which a quick compile at a provisional
page count estimates (`kv_sizing.py`). On a warm start those compiles are cache hits, but a hit still
traces and lowers the step, loads the executable and compiles its Mosaic GPU kernels again: one round of
the largest buckets spent on a figure the last start already had. So the sizing's figure is recorded here,
under a fingerprint of everything that shapes the step (the runner's), and a start that finds it sizes
the cache from it and goes straight to the real compiles, which load from the persistent cache at the page
count the earlier start chose.

A record that no longer fits the step cannot overrun the device: the sizing checks the real compile's temp
memory against what it kept, and sizes the cache again where it is over (and records the new figure).
Each record is one small JSON file written whole (a temporary file renamed), so a start that reads while
another writes finds the old record or the new one; one it cannot read counts as none.
"""

import hashlib
import json
import logging
import os
import re
import tempfile
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

SUBDIRECTORY = "jaxserve-step-temp"  # under the persistent compilation cache's directory

# A default repr's object address (`<function gelu at 0x7f...>`): the same object at another address in the
# next process.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def fingerprint(*parts: object) -> str:
    """A digest of the parts' reprs, object addresses left out: the same in every process for equal parts."""
    text = "\n".join(_ADDRESS.sub("", repr(part)) for part in parts)
    return hashlib.sha256(text.encode()).hexdigest()


@lru_cache(maxsize=1)
def source_digest() -> str:
    """A digest of jaxserve's own Python sources: a record from other code is not taken as this code's."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


class TempRecords:
    """Step temp-memory figures by fingerprint, in `cache_dir`/SUBDIRECTORY."""

    def __init__(self, cache_dir: str | os.PathLike) -> None:
        self.directory = Path(cache_dir).expanduser() / SUBDIRECTORY

    def read(self, key: str) -> int | None:
        """The figure recorded under `key`; None where there is none or it cannot be read."""
        try:
            record = json.loads((self.directory / f"{key}.json").read_text())
            temp_bytes = record["temp_bytes"]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.debug("step temp record %s unreadable: %s", key, error)
            return None
        return temp_bytes if isinstance(temp_bytes, int) and temp_bytes >= 0 else None

    def write(self, key: str, temp_bytes: int) -> None:
        """Records `temp_bytes` under `key`; a directory that cannot be written is logged and skipped (the
        next start estimates again)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.directory, suffix=".tmp", delete=False) as f:
                json.dump({"temp_bytes": int(temp_bytes)}, f)
            os.replace(f.name, self.directory / f"{key}.json")
        except OSError as error:
            logger.warning("could not record the step's temp memory in %s: %s", self.directory, error)
