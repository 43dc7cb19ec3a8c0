"""Building the native CPU kernels' shared library (`cpu_kernels/`), with no jax import: a CPU host's start
begins the build on a thread before it imports jax (`start_early`), and the kernels' first use waits for it
(`built_library`).

The sources are compiled one per compiler process at once, then linked. The library is cached under
`JAXSERVE_KERNEL_CACHE` (default `~/.cache/jaxserve/kernels`), keyed by the sources, the flags, the
compiler, jaxlib's version and this CPU's feature flags, so a changed machine or source builds anew. A
build holds a lock file beside the library, so another process asking for the same library (the engine
core's process, a test worker) waits for it instead of building it again; it writes a temporary file
and renames it into place, so nothing reads half a library.
"""

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCES = ("ragged_paged_attention.cc", "matmul_gguf.cc", "matmul_bf16.cc", "write_kv.cc")  # longest build first
HEADERS = ("work_sharing.h",)
LIBRARY = "jaxserve_kernels"
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-fPIC", "-w")  # compiling
# Linking is a separate step without -ffast-math: GCC 12 links crtfastmath.o into any -ffast-math link, even
# -shared, whose constructor turns on flush-to-zero for the thread that loads the library, for good.
BUILD_TIMEOUT_S = 120


class NativeKernelUnavailable(RuntimeError):
    """The native CPU kernels could not be built or loaded here (the message says why)."""


def flags() -> tuple[str, ...]:
    """FLAGS, then `JAXSERVE_KERNEL_FLAGS` (say `-mno-avx512bf16`, to build the portable loops)."""
    return (*FLAGS, *os.environ.get("JAXSERVE_KERNEL_FLAGS", "").split())


def find_compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _cache_dir() -> Path:
    return Path(os.environ.get("JAXSERVE_KERNEL_CACHE", "~/.cache/jaxserve/kernels")).expanduser()


def _include_dir() -> str:
    """jaxlib's headers (XLA's FFI API): `jax.ffi.include_dir()`, without importing jax."""
    import jaxlib  # here, not at the top: the CLI imports this module for every command, `--help` too

    return os.path.join(os.path.dirname(os.path.abspath(jaxlib.__file__)), "include")


def _run_step(what: str, command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if result.returncode != 0:
        raise NativeKernelUnavailable(f"building {what} failed: {result.stderr.strip()[-2000:]}")


def _sources() -> dict[str, bytes]:
    sources = resources.files(__package__).joinpath("cpu_kernels")  # this package, not cpu_kernels' (jax)
    return {name: sources.joinpath(name).read_bytes() for name in (*SOURCES, *HEADERS)}


def library_path(compiler: str) -> Path:
    """Where the library for `compiler`, these sources and flags, jaxlib and this CPU is cached."""
    import jaxlib

    key = hashlib.sha256(b"\0".join([
        *(name.encode() + b"\0" + text for name, text in _sources().items()), " ".join(flags()).encode(),
        b"link: -shared", compiler.encode(), jaxlib.__version__.encode(), _cpu_flags().encode(),
    ])).hexdigest()[:16]
    return _cache_dir() / f"{LIBRARY}-{key}.so"


def build(compiler: str) -> Path:
    """The library for `compiler` and this machine: from the cache, or built now (raises
    NativeKernelUnavailable, OSError or subprocess.TimeoutExpired)."""
    library = library_path(compiler)
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    lock_path = library.with_suffix(".lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process ends
        try:
            if not library.exists():  # else another process built it while this one waited
                _compile_and_link(compiler, _sources(), library)
        finally:
            # A process still waiting on this file finds the library when it gets the lock; at worst (a
            # failed build, or a lock file made anew meanwhile) two processes build it at once, each
            # renaming its own copy into place.
            lock_path.unlink(missing_ok=True)
    return library


def _compile_and_link(compiler: str, files: dict[str, bytes], library: Path) -> None:
    logger.info("building the native CPU kernels for this machine (once; cached in %s)", library.parent)
    with tempfile.TemporaryDirectory() as scratch:
        for name, text in files.items():
            (Path(scratch) / name).write_bytes(text)
        objects = [str(Path(scratch) / f"{Path(name).stem}.o") for name in SOURCES]
        built = Path(scratch) / library.name
        compiles = [(name, [compiler, *flags(), f"-I{_include_dir()}", "-c", str(Path(scratch) / name), "-o", obj])
                    for name, obj in zip(SOURCES, objects, strict=True)]
        # One compiler per source at once (up to a core each), the longest first (SOURCES' order); a failure is
        # reported for the first source in that order that failed, once every compile has ended.
        with ThreadPoolExecutor(max_workers=min(len(compiles), os.cpu_count() or 1)) as pool:
            for compiled in [pool.submit(_run_step, *step) for step in compiles]:
                compiled.result()
        _run_step(library.name, [compiler, "-shared", *objects, "-o", str(built)])
        staged = library.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(built, staged)
        os.replace(staged, library)


_lock = threading.Lock()
_outcome: Path | NativeKernelUnavailable | None = None  # this process's build, once done


def built_library() -> Path:
    """This process's library, built (or found) once; a build `start_early` began is waited for. Raises
    NativeKernelUnavailable saying why there is none."""
    global _outcome
    with _lock:
        if _outcome is None:
            compiler = find_compiler()
            if compiler is None:
                _outcome = NativeKernelUnavailable("no C++ compiler found (set CXX, or install g++)")
            else:
                try:
                    _outcome = build(compiler)
                except (NativeKernelUnavailable, OSError, subprocess.TimeoutExpired) as error:
                    _outcome = NativeKernelUnavailable(str(error))
    if isinstance(_outcome, NativeKernelUnavailable):
        raise _outcome
    return _outcome


def _build_quietly() -> None:
    with contextlib.suppress(NativeKernelUnavailable):  # said where the kernels are first used (`kernel_error`)
        built_library()


def start_early() -> None:
    """Begins `built_library()` on a thread, for a start that will run on the CPU: the compilers run while
    the process imports jax and loads the model. Returns at once."""
    threading.Thread(target=_build_quietly, name="jaxserve-kernel-build", daemon=True).start()
