"""Building the native CPU kernels' shared library (`cpu_kernels/`), with no jax import: a CPU host's start
begins the build on a thread before it imports jax (`start_early`), and the kernels' first use waits for it
(`built_library`).

The sources are compiled at once, one compiler process each, then linked. The library is cached under
`JAXSERVE_KERNEL_CACHE` (default `~/.cache/jaxserve/kernels`), keyed by the sources, the flags, the
compiler, jaxlib's version and this CPU's feature flags, so a changed machine or source builds anew. A
build holds a lock file beside the library, so another process asking for the same library (the engine
core's process, a test worker) waits for it (up to LOCK_WAIT_S, then builds too) instead of building it
again; it writes a temporary file and renames it into place, so nothing reads half a library.

A process that exits while its build runs (a mistyped flag, a SIGTERM while loading) kills its compilers
and removes their scratch directory at exit rather than waiting for them (`_stop_compilers`).
"""

import atexit
import contextlib
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCES = ("ragged_paged_attention.cc", "matmul_gguf.cc", "matmul_bf16.cc", "write_kv.cc", "ffi_bindings.cc")
HEADERS = ("kernels.h", "work_sharing.h")
LIBRARY = "jaxserve_kernels"
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-fPIC", "-w")  # compiling
# Linking is a separate step without -ffast-math: GCC 12 links crtfastmath.o into any -ffast-math link, even
# -shared, whose constructor turns on flush-to-zero for the thread that loads the library, for good.
# After FLAGS for one source: the handlers only hand each call's buffers on, and XLA's binding templates
# compile in much less time at -O1 (docs/benchmarks.md, stop 96).
SOURCE_FLAGS = {"ffi_bindings.cc": ("-O1",)}
BUILD_TIMEOUT_S = 120  # the compiles together, then the link
LOCK_WAIT_S = 2 * BUILD_TIMEOUT_S  # another process's build of the same library, before building it here too


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


def _sources() -> dict[str, bytes]:
    sources = resources.files(__package__).joinpath("cpu_kernels")  # this package, not cpu_kernels' (jax)
    return {name: sources.joinpath(name).read_bytes() for name in (*SOURCES, *HEADERS)}


def library_path(compiler: str, files: dict[str, bytes] | None = None,
                 build_flags: tuple[str, ...] | None = None) -> Path:
    """Where the library for `compiler`, these sources and flags, jaxlib and this CPU is cached."""
    import jaxlib

    files = _sources() if files is None else files
    build_flags = flags() if build_flags is None else build_flags
    key = hashlib.sha256(b"\0".join([
        *(name.encode() + b"\0" + text for name, text in files.items()), " ".join(build_flags).encode(),
        repr(sorted(SOURCE_FLAGS.items())).encode(), b"link: -shared", compiler.encode(), jaxlib.__version__.encode(),
        _cpu_flags().encode(),
    ])).hexdigest()[:16]
    return _cache_dir() / f"{LIBRARY}-{key}.so"


def build(compiler: str) -> Path:
    """The library for `compiler` and this machine: from the cache, or built now (raises
    NativeKernelUnavailable, OSError or subprocess.TimeoutExpired)."""
    files, build_flags = _sources(), flags()  # read once: the key is the build's
    library = library_path(compiler, files, build_flags)
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(library.with_suffix(".lock")):
        if not library.exists():  # else another process built it while this one waited
            _compile_and_link(compiler, files, build_flags, library)
    return library


@contextlib.contextmanager
def _build_lock(lock_path: Path) -> Iterator[None]:
    """Holds `lock_path`'s lock while the library is built. Another process's build is waited for up to
    LOCK_WAIT_S (a stopped process would hold it for ever), then this one builds too; a filesystem without
    locks builds without one. Either way the rename into place keeps the library whole."""
    import fcntl  # POSIX: here, not at the top, where the CLI's import would need it everywhere

    with open(lock_path, "w") as lock:
        deadline, said = time.monotonic() + LOCK_WAIT_S, False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the file closes
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    logger.warning("another process has built the native CPU kernels for %ds; building them "
                                   "here too", LOCK_WAIT_S)
                    break
                if not said:
                    logger.info("waiting for another process's build of the native CPU kernels")
                    said = True
                time.sleep(0.1)
            except OSError:  # no locks on this filesystem (NFS without lockd)
                break
        try:
            yield
        finally:
            # A process still waiting on this file finds the library when it gets the lock; at worst (a
            # failed build, or a lock file made anew meanwhile) two processes build it at once, each
            # renaming its own copy into place.
            lock_path.unlink(missing_ok=True)


_children_lock = threading.Lock()
_children: set[subprocess.Popen] = set()  # compilers running
_scratch_dirs: set[str] = set()
_exiting = False


@atexit.register
def _stop_compilers() -> None:
    """At exit, kills the compilers still running and removes their scratch directories: a process that
    exits mid-build does not wait for them (its build's thread is a daemon, stopped with the process)."""
    global _exiting
    with _children_lock:
        _exiting = True
        for child in _children:
            child.kill()
        for scratch in _scratch_dirs:
            shutil.rmtree(scratch, ignore_errors=True)


def _run_at_once(steps: list[tuple[str, list[str]]], logs: Path) -> None:
    """Runs every command at once, one process each (stderr to a file in `logs`), and waits for all, up to
    BUILD_TIMEOUT_S together; raises for the first in `steps`' order that failed."""
    started: list[tuple[str, subprocess.Popen]] = []
    try:
        for what, command in steps:
            with _children_lock:
                if _exiting:
                    raise NativeKernelUnavailable("the process is exiting")
                with open(logs / f"{what}.err", "w") as err:
                    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
                _children.add(child)
            started.append((what, child))
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        for _, child in started:
            child.wait(max(0.0, deadline - time.monotonic()))  # raises TimeoutExpired
    finally:
        for _, child in started:
            if child.poll() is None:
                child.kill()
                child.wait()
            with _children_lock:
                _children.discard(child)
    for what, child in started:
        if child.returncode != 0:
            message = (logs / f"{what}.err").read_text().strip()[-2000:]
            raise NativeKernelUnavailable(f"building {what} failed: {message}")


def _compile_and_link(compiler: str, files: dict[str, bytes], build_flags: tuple[str, ...], library: Path) -> None:
    logger.info("building the native CPU kernels for this machine (once; cached in %s)", library.parent)
    scratch = Path(tempfile.mkdtemp(prefix="jaxserve-kernels-"))
    with _children_lock:
        _scratch_dirs.add(str(scratch))
    try:
        for name, text in files.items():
            (scratch / name).write_bytes(text)
        objects = [str(scratch / f"{Path(name).stem}.o") for name in SOURCES]
        _run_at_once([(name, [compiler, *build_flags, *SOURCE_FLAGS.get(name, ()), f"-I{_include_dir()}", "-c",
                              str(scratch / name), "-o", obj])
                      for name, obj in zip(SOURCES, objects, strict=True)], scratch)
        built = scratch / library.name
        _run_at_once([(library.name, [compiler, "-shared", *objects, "-o", str(built)])], scratch)
        staged = library.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(built, staged)
        os.replace(staged, library)
    finally:
        with _children_lock:
            _scratch_dirs.discard(str(scratch))
        shutil.rmtree(scratch, ignore_errors=True)


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
    try:
        built_library()
    except Exception:  # a failure is said where the kernels are first used (`kernel_error`)
        logger.debug("the early build of the native CPU kernels failed", exc_info=True)


def start_early() -> threading.Thread:
    """Begins `built_library()` on a thread, for a start that will run on the CPU: the compilers run while
    the process imports jax and loads the model. Returns at once, with the thread."""
    thread = threading.Thread(target=_build_quietly, name="jaxserve-kernel-build", daemon=True)
    thread.start()
    return thread
