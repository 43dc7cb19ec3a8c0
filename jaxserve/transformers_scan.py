"""transformers' scans of its own source tree, remembered between starts.

transformers 5 learns what each of its modules exports by reading their source: at its import, and again
when `transformers.models` is first imported (AutoConfig's import, which every start makes to read the
model's config), `define_import_structure` reads the source of every model family (1,696 files) and
matches their `__all__` lists. That is most of transformers' import time, at every start, for a result
that changes only with the files (docs/benchmarks.md, stop 94).

`remember_scans()` wraps that function, before transformers is imported, with a record on disk: keyed
by the scanned folder (a package's `__init__.py` stands for its folder, as transformers takes it), the
prefix, the path, size, modification time and inode of every file under the folder, and the scanner's own
file, so any change to transformers' files (an upgrade, an edited checkout) scans afresh. The wrapper
returns what the scan returned, unpickled anew at each call. Where anything is not as expected (no such
function, a record that cannot be read or written) transformers' own scan runs, as without it.
"""

import contextlib
import functools
import hashlib
import importlib.abc
import importlib.machinery
import logging
import os
import pickle
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from jaxserve.config import cache_home

logger = logging.getLogger(__name__)

_MODULE = "transformers.utils.import_utils"  # where the scan is defined
_FUNCTION = "define_import_structure"  # (module_path, prefix=None) -> the import structure
_RECORD_VERSION = b"1"  # of this module's key and record format


def remember_scans() -> bool:
    """Installs the wrapper for transformers' next import; False where transformers (or its module) is
    imported already, whose scans have run."""
    if "transformers" in sys.modules or _MODULE in sys.modules:
        return False
    if not any(isinstance(finder, _WrapOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WrapOnImport())
    return True


def _records_dir() -> Path:
    return cache_home() / "transformers-scans"


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds `_MODULE` on the parent package's path, as the import system would, and loads it through
    `_WrappingLoader`."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # the other finders find it, unwrapped
        spec.loader = _WrappingLoader(spec.loader)
        return spec


class _WrappingLoader(importlib.abc.Loader):
    """`loader`, which wraps the module's scan once the module has run; anything else asked of it (the
    source, for tracebacks) is `loader`'s."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        scan = getattr(module, _FUNCTION, None)
        if callable(scan) and not getattr(scan, "jaxserve_records", False):
            setattr(module, _FUNCTION, _remembered(scan, getattr(module, "__file__", None)))


def _remembered(scan: Callable[..., Any], scanner: str | None = None) -> Callable[..., Any]:
    """`scan` with records; `scanner`: the file that defines it (part of every key: a changed scan rescans)."""
    lock = threading.Lock()

    @functools.wraps(scan)
    def remembered(module_path: Any, prefix: str | None = None) -> Any:
        try:
            key = _key(Path(module_path), prefix, scanner)
        except OSError:
            return scan(module_path, prefix)
        record = _records_dir() / f"{key}.pickle"
        with lock:
            try:
                return pickle.loads(record.read_bytes())
            except FileNotFoundError:
                pass
            except Exception as error:  # a damaged record: scanned and written again
                logger.debug("transformers scan record %s unreadable: %s", record, error)
            structure = scan(module_path, prefix)
            _write(record, structure)
            return structure

    remembered.jaxserve_records = True  # type: ignore[attr-defined]  # a module run again keeps one wrapper
    return remembered


def _key(module_path: Path, prefix: str | None, scanner: str | None) -> str:
    """A digest of the scanned directory (a package's `__init__.py` stands for its folder, as transformers
    takes it), the prefix, the files under the directory and the scanner's own file."""
    directory = module_path.parent if module_path.is_file() else module_path
    scanner_stat = os.stat(scanner) if scanner else None
    scanner_facts = f"{scanner}\0{scanner_stat.st_size}\0{scanner_stat.st_mtime_ns}" if scanner_stat else ""
    return hashlib.sha256(b"\0".join([_RECORD_VERSION, repr(prefix).encode(), scanner_facts.encode(),
                                       _files_digest(str(directory.resolve())).encode()])).hexdigest()


@functools.lru_cache(maxsize=8)  # per process, as transformers keeps its scans: `models` is asked twice
def _files_digest(directory: str) -> str:
    """A digest of `directory` and every file under it (relative path, size, modification time, inode),
    folders followed through links as transformers follows them, Python's bytecode caches left out."""
    digest = hashlib.sha256(directory.encode())
    pending = [(directory, "")]
    while pending:
        folder, relative = pending.pop()
        with os.scandir(folder) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                name = f"{relative}/{entry.name}"
                if entry.is_dir():
                    if entry.name != "__pycache__":  # Python's own, rewritten as it pleases
                        pending.append((entry.path, name))
                else:
                    stat = entry.stat()
                    digest.update(f"\0{name}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ino}".encode())
    return digest.hexdigest()


def _write(record: Path, structure: Any) -> None:
    """Writes the record whole (a file of its own renamed over it); one that cannot be written is skipped."""
    own = record.with_name(f"{record.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        payload = pickle.dumps(structure, protocol=pickle.HIGHEST_PROTOCOL)
        record.parent.mkdir(parents=True, exist_ok=True)
        own.write_bytes(payload)
        os.replace(own, record)
    except (OSError, pickle.PicklingError, TypeError) as error:
        with contextlib.suppress(OSError):
            own.unlink(missing_ok=True)
        logger.debug("transformers scan not recorded in %s: %s", record.parent, error)
