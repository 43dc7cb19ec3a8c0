"""The process's memory allocator: tcmalloc when one is found, preloaded by re-executing the CLI once.

Why. XLA:CPU allocates each step's temporaries with malloc and frees them when the step ends, on its own
threads. Under glibc's malloc two things follow:
- a block over 32 MB (the [R, V] logits: 50 MB at 256 rows of a 49,152-token vocabulary) is always its
  own mmap, returned at free, so every step faults its pages in again;
- the many small blocks the step frees land in the main arena's bins, and the engine thread's next
  mid-size malloc pays to sort them (`_int_malloc`, `malloc_consolidate`): 0.5 ms of any Python that
  allocates right after a step.
tcmalloc keeps both in its caches. On a 2-core CPU it halved the device time of a 256-sequence step of a
tiny model and took 12-18% off SmolLM2's single-sequence TPOT in bfloat16 (docs/benchmarks.md). vLLM's CPU
backend asks for the same (LD_PRELOAD of libtcmalloc_minimal.so.4).

How. An allocator is chosen when the process starts, so `preload_tcmalloc()` re-executes the command with
LD_PRELOAD set (the PID, the arguments and stdio stay). Child processes (the engine core's) inherit it.
`make setup` places a copy in the virtual environment (`scripts/fetch_tcmalloc.sh`); a system-wide
gperftools install is found too. JAXSERVE_ALLOCATOR=glibc keeps glibc's; =<path> names the library.
"""

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

ALLOCATOR_ENV = "JAXSERVE_ALLOCATOR"
_REEXECUTED_ENV = "JAXSERVE_ALLOCATOR_PRELOADED"  # set for the re-executed process: never twice
_LIBRARY_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
_SYSTEM_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                "/usr/local/lib")
# gperftools reports every allocation over 1 GiB on stderr; a CPU KV cache is one.
_REPORT_THRESHOLD_ENV = "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"


def venv_library_dir() -> Path:
    """Where `make setup` puts its copy: inside the environment this interpreter runs in."""
    return Path(sys.prefix) / "lib" / "jaxserve"


def find_tcmalloc() -> Path | None:
    """The tcmalloc library to preload: JAXSERVE_ALLOCATOR's path, the environment's copy, or the system's;
    None when there is none or JAXSERVE_ALLOCATOR=glibc."""
    setting = os.environ.get(ALLOCATOR_ENV, "")
    if setting == "glibc":
        return None
    if setting not in ("", "tcmalloc"):
        path = Path(setting)
        if not path.is_file():
            raise ValueError(f"{ALLOCATOR_ENV}={setting}: no such file (a library path, 'tcmalloc' or 'glibc')")
        return path
    for directory in (venv_library_dir(), *map(Path, _SYSTEM_DIRS)):
        for name in _LIBRARY_NAMES:
            if (directory / name).is_file():
                return directory / name
    if setting == "tcmalloc":
        raise ValueError(f"{ALLOCATOR_ENV}=tcmalloc: none found in {venv_library_dir()} or {', '.join(_SYSTEM_DIRS)}")
    return None


_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")  # a preloaded one of these is respected
# The CLI's commands that run steps, whose speed the allocator decides; the others (`compile`, `--help`)
# are not started twice.
STEP_COMMANDS = (("serve",), ("generate",), ("bench", "offline"), ("bench", "buckets"))


def runs_steps(args: Sequence[str]) -> bool:
    """Whether the command line `args` (the arguments after the program) is one of STEP_COMMANDS."""
    return any(tuple(args[:len(command)]) == command for command in STEP_COMMANDS)


def loaded_allocator() -> str:
    """'tcmalloc', 'jemalloc' or 'mimalloc' when one is mapped into this process, else 'glibc' ('system'
    where /proc is not there to say)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux
        return "system"
    return next((name for name in _ALLOCATORS if f"lib{name}" in maps), "glibc")


def preload_tcmalloc() -> None:
    """Re-executes this process's command with tcmalloc preloaded, unless another allocator is loaded
    already, it was preloaded once (a library that failed to load is not retried), or none is found; and
    without it when JAXSERVE_ALLOCATOR=glibc but a parent's preload was inherited. Call it first thing in a
    command-line entry point: nothing done before it survives but the PID, the arguments and stdio.
    Raises ValueError when a library asked for by name or path could not be loaded."""
    setting = os.environ.get(ALLOCATOR_ENV, "")
    loaded = loaded_allocator()
    if os.environ.get(_REEXECUTED_ENV):
        if setting == "glibc" and loaded == "tcmalloc":  # inherited from a process that preloaded it
            env = {k: v for k, v in os.environ.items() if k != _REEXECUTED_ENV}
            env["LD_PRELOAD"] = " ".join(w for w in env.get("LD_PRELOAD", "").split() if "libtcmalloc" not in w)
            _reexecute(env)
        elif setting not in ("", "glibc") and loaded != "tcmalloc":
            raise ValueError(f"{ALLOCATOR_ENV}={setting}: the library could not be preloaded (see the loader's "
                             "message above)")
        return
    if loaded != "glibc":
        return
    library = find_tcmalloc()
    if library is None:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(filter(None, (str(library), env.get("LD_PRELOAD"))))
    env[_REEXECUTED_ENV] = "1"
    env.setdefault(_REPORT_THRESHOLD_ENV, str(2**50))
    _reexecute(env)


def _reexecute(env: dict[str, str]) -> None:
    """This command again in this process; on failure (a permission, a vanished interpreter) carries on."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:  # argv[0] is the interpreter's path: Python would look a bare name up on PATH again
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError as e:
        logger.warning("could not re-execute to change the memory allocator: %s", e)


def allocator_note() -> str:
    """The start-up log's line: the allocator steps run under, and how to get tcmalloc if not."""
    name = loaded_allocator()
    if name != "glibc":
        return f"memory allocator: {name}"
    try:
        library = find_tcmalloc()
    except ValueError as e:  # a Python API user's bad setting: the CLI would have stopped on it
        return f"memory allocator: glibc ({e})"
    if library is not None:  # found but not preloaded: a Python API user's process
        return f"memory allocator: glibc; for faster CPU steps, start Python with LD_PRELOAD={library}"
    return ("memory allocator: glibc; tcmalloc makes CPU steps faster (`make setup` fetches it with apt; "
            "or install gperftools' libtcmalloc-minimal4)")
