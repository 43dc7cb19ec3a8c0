"""The native CPU kernels' build (`ops/kernel_build.py`): cached by source and machine, one build where
two processes ask at once, a failure that says why, and a start on a CPU host that begins the build before
it imports jax, which the kernels' first use waits for."""

import fcntl
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jaxserve import cli
from jaxserve.ops import kernel_build
from jaxserve.platform import cpu_backend_expected

COMPILER = kernel_build.find_compiler()
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler: the native kernels cannot be built here")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path))
    return tmp_path


@needs_compiler
def test_a_build_is_cached_by_source_and_machine(cache: Path):
    library = kernel_build.build(COMPILER)
    assert library == kernel_build.library_path(COMPILER) and library.parent == cache and library.suffix == ".so"
    built_at = os.stat(library).st_mtime_ns
    assert kernel_build.build(COMPILER) == library and os.stat(library).st_mtime_ns == built_at
    assert [p.name for p in cache.iterdir()] == [library.name], "no temporary or lock files are left"


def test_a_failed_build_says_so(cache: Path):
    with pytest.raises(kernel_build.NativeKernelUnavailable, match=r"building ragged_paged_attention\.cc failed"):
        kernel_build.build("false")  # a "compiler" that always fails
    assert list(cache.iterdir()) == []


def test_a_build_under_way_elsewhere_is_waited_for_not_repeated(cache: Path, monkeypatch):
    """Another process holds the library's lock (here, this test): `build` waits, then takes the library
    that process made. Its own compiler (`false`) would fail, so a build of its own would raise."""
    library = kernel_build.library_path("false")
    tries: list[int] = []
    real_flock = fcntl.flock
    monkeypatch.setattr(fcntl, "flock", lambda f, op: (tries.append(op), real_flock(f, op))[1])
    outcome: list = []
    with open(library.with_suffix(".lock"), "w") as lock:
        real_flock(lock, fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: outcome.append(kernel_build.build("false")))
        waiter.start()
        deadline = time.monotonic() + 30
        while len(tries) < 2 and time.monotonic() < deadline:  # it found the lock taken, and tried again
            time.sleep(0.05)
        assert len(tries) >= 2 and waiter.is_alive() and not outcome, "the build did not wait for the lock"
        library.write_bytes(b"the other process's library")
    waiter.join(10)
    assert outcome == [library]


def test_the_first_use_waits_for_the_early_build(cache: Path, monkeypatch):
    """`start_early`'s thread builds; a first use meanwhile waits for that build and builds nothing itself."""
    builders: list[str] = []
    release = threading.Event()

    def held_build(compiler: str) -> Path:
        builders.append(threading.current_thread().name)
        assert release.wait(30)
        return cache / "built.so"

    monkeypatch.setattr(kernel_build, "build", held_build)
    monkeypatch.setattr(kernel_build, "_outcome", None)  # this process's build, made again
    monkeypatch.setenv("CXX", shutil.which("true") or "true")
    early = kernel_build.start_early()
    deadline = time.monotonic() + 30
    while not builders and time.monotonic() < deadline:
        time.sleep(0.01)
    first_use: list[Path] = []
    user = threading.Thread(target=lambda: first_use.append(kernel_build.built_library()))
    user.start()
    time.sleep(0.3)
    assert user.is_alive() and not first_use, "the first use did not wait for the early build"
    release.set()
    user.join(10)
    early.join(10)
    assert first_use == [cache / "built.so"] and builders == ["jaxserve-kernel-build"]


EXIT_MID_BUILD = """
import os, sys, time
from pathlib import Path
from jaxserve.ops import kernel_build
kernel_build.start_early()
deadline = time.monotonic() + 30
pids = Path(os.environ["CXX"]).parent / "pids"  # each "compiler" writes its pid there as it starts


def started() -> int:
    return len(pids.read_text().split()) if pids.exists() else 0

while started() < len(kernel_build.SOURCES) and time.monotonic() < deadline:
    time.sleep(0.05)
print("compiling", len(kernel_build._children), flush=True)
sys.exit(0)
"""


def test_a_process_that_exits_mid_build_stops_its_compilers(tmp_path: Path):
    """A start that ends while its first build runs (a bad flag, a SIGTERM while loading) exits at once:
    its compilers (here a "compiler" that takes 60 s) are killed and their scratch directory removed."""
    compiler = tmp_path / "slow-c++"
    compiler.write_text("#!/bin/sh\necho $$ >> \"$(dirname \"$0\")/pids\"\nexec sleep 60\n")
    compiler.chmod(0o755)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "CXX": str(compiler), "JAXSERVE_KERNEL_CACHE": str(tmp_path / "kernels"),
           "TMPDIR": str(scratch)}
    # The run's timeout is the bound: a process that waited for its "compiler" (60 s) would exceed it.
    result = subprocess.run([sys.executable, "-c", EXIT_MID_BUILD], env=env, capture_output=True, text=True,
                            timeout=50, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0 and f"compiling {len(kernel_build.SOURCES)}" in result.stdout, result.stderr
    assert list(scratch.iterdir()) == [], "the scratch directory was left"
    time.sleep(0.5)
    pids = [int(pid) for pid in (tmp_path / "pids").read_text().split()]
    assert len(pids) == len(kernel_build.SOURCES)
    alive = [pid for pid in pids if Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)]
    assert alive == [], "compilers outlived the process"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def test_without_a_compiler_the_reason_is_kept(monkeypatch):
    monkeypatch.setattr(kernel_build, "find_compiler", lambda: None)
    monkeypatch.setattr(kernel_build, "_outcome", None)
    for _ in range(2):
        with pytest.raises(kernel_build.NativeKernelUnavailable, match="no C\\+\\+ compiler found"):
            kernel_build.built_library()


def test_the_cpu_is_expected_from_jax_platforms_or_the_device_nodes(monkeypatch):
    assert cpu_backend_expected({"JAX_PLATFORMS": "cpu"})
    assert cpu_backend_expected({"JAX_PLATFORMS": "cpu,cuda"})
    assert not cpu_backend_expected({"JAX_PLATFORMS": "cuda"})
    assert not cpu_backend_expected({"JAX_PLATFORMS": "tpu,cpu"})
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda path: path == "/dev/nvidiactl" or real_exists(path))
    assert not cpu_backend_expected({})


@pytest.mark.parametrize("argv, starts", [(["generate", "--model", "m", "--prompt", "hi"], True),
                                         (["convert", "m", "out"], False)])
def test_a_step_command_on_a_cpu_host_starts_the_build_first(argv, starts, monkeypatch):
    started: list[bool] = []
    ran: list[str] = []
    monkeypatch.setattr(kernel_build, "start_early", lambda: started.append(True))
    monkeypatch.setattr(cli, "cpu_backend_expected", lambda: True)
    monkeypatch.setattr(cli, "prepare_jax_platform", lambda: None)  # it would set a variable in os.environ
    for name in ("_cmd_generate", "_cmd_convert"):
        monkeypatch.setattr(cli, name, lambda args, name=name: ran.append(name))
    cli.main(argv)
    assert len(ran) == 1 and started == ([True] if starts else [])
    monkeypatch.setattr(cli, "cpu_backend_expected", lambda: False)
    cli.main(argv)
    assert started == ([True] if starts else [])
