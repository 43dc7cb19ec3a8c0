"""The step's temp memory as a start's KV sizing found it, kept beside JAX's persistent compilation cache,
so that a warm start sizes its cache as the earlier start did (no jax).

A GPU start sizes its KV cache from an estimate of the largest buckets' temp memory: from the step's shapes,
or from quick compiles at a provisional page count where those leave too little room (`kv_sizing.py`). The
page count is one of the step's shapes, so a warm start must size from the same figure as the earlier one
for its real compiles to be the earlier start's executables; and where that figure came from compiles,
those would be a round of the largest buckets spent on a figure the last start already had (a cache hit
still traces and lowers the step and loads the executable). So the sizing's figure is recorded here,
under a fingerprint of everything that shapes the step (the runner's), and a start that finds it sizes
the cache from it and goes straight to the real compiles, which load from the persistent cache at the page
count the earlier start chose.

A record also keeps the real compile's temp memory. A warm start's real compile is the earlier start's
executable, so its figure must be the recorded one; where it is not, the step changed in a way the
fingerprint missed, and the record is dropped (the next start estimates again). A record too small for the
step cannot overrun the device either way: the sizing checks the real compile's temp memory against what
it kept, and sizes the cache again where it is over (and records the new figures).
Each record is one small JSON file written whole (a file of its own renamed over it, with the umask's
permissions, as JAX's cache entries), so a start that reads while another writes finds the old record or
the new one; one it cannot read counts as none.
"""

import contextlib
import hashlib
import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

SUBDIRECTORY = "jaxserve-step-temp"  # under the persistent compilation cache's directory

# A default repr's object address (`<function gelu at 0x7f...>`): the same object at another address in the
# next process.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def fingerprint(*parts: object) -> str:
    """A digest of the parts' reprs, object addresses left out: the same in every process for equal parts
    whose reprs are deterministic (not sets of strings, whose order follows the hash seed)."""
    text = "\n".join(_ADDRESS.sub("", repr(part)) for part in parts)
    return hashlib.sha256(text.encode()).hexdigest()


_PACKAGE = Path(__file__).resolve().parents[1]


@lru_cache(maxsize=4)
def source_digest(package: Path = _PACKAGE) -> str:
    """A digest of jaxserve's own Python sources (`package`'s): a record from other code is not taken as
    this code's. What is not a readable regular file (an editor's lock link) is left out."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        try:
            text = path.read_bytes() if path.is_file() else None
        except OSError:
            text = None
        if text is not None:
            digest.update(str(path.relative_to(package)).encode())
            digest.update(text)
    return digest.hexdigest()


@dataclass(frozen=True)
class StepTempRecord:
    sized_for_bytes: int  # the temp memory the budget kept its margin over
    compiled_bytes: int  # the largest buckets' real compile's peak temp memory, at the page count it gave


class TempRecords:
    """Step temp-memory records by fingerprint, in `cache_dir`/SUBDIRECTORY."""

    def __init__(self, cache_dir: str | os.PathLike) -> None:
        self.directory = Path(cache_dir).expanduser() / SUBDIRECTORY

    @classmethod
    def beside(cls, cache_dir: str | None) -> "TempRecords | None":
        """The records beside a persistent compilation cache; None without one, or where it is not a local
        directory (JAX also takes gs:// and other URLs)."""
        return cls(cache_dir) if cache_dir and "://" not in cache_dir else None

    def read(self, key: str) -> StepTempRecord | None:
        """The record under `key`; None where there is none or it cannot be read."""
        try:
            values = json.loads(self._path(key).read_text())
            record = StepTempRecord(values["sized_for_bytes"], values["compiled_bytes"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.debug("step temp record %s unreadable: %s", key, error)
            return None
        figures = (record.sized_for_bytes, record.compiled_bytes)
        return record if all(isinstance(x, int) and x >= 0 for x in figures) else None

    def write(self, key: str, record: StepTempRecord) -> None:
        """Records `record` under `key`; a directory that cannot be written is logged and skipped (the next
        start estimates again)."""
        own = self.directory / f"{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with os.fdopen(os.open(own, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666), "w") as f:
                json.dump({"sized_for_bytes": int(record.sized_for_bytes),
                           "compiled_bytes": int(record.compiled_bytes)}, f)
            os.replace(own, self._path(key))
        except OSError as error:
            with contextlib.suppress(OSError):
                own.unlink(missing_ok=True)
            logger.warning("could not record the step's temp memory in %s: %s", self.directory, error)

    def forget(self, key: str) -> None:
        with contextlib.suppress(OSError):
            self._path(key).unlink(missing_ok=True)

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.json"
