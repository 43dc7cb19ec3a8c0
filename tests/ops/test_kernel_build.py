"""The native CPU kernels' build (`ops/kernel_build.py`): cached by source and machine, one build where
two processes ask at once, a failure that says why, and a start on a CPU host that begins the build before
it imports jax, which the kernels' first use waits for."""

import fcntl
import os
import shutil
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


def test_a_build_under_way_elsewhere_is_waited_for_not_repeated(cache: Path):
    """Another process holds the library's lock (here, this test): `build` waits, then takes the library
    that process made. Its own compiler (`false`) would fail, so a build of its own would raise."""
    library = kernel_build.library_path("false")
    outcome: list = []
    with open(library.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: outcome.append(kernel_build.build("false")))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive() and not outcome, "the build did not wait for the lock"
        library.write_bytes(b"the other process's library")
    waiter.join(10)
    assert outcome == [library]


def test_the_first_use_waits_for_the_early_build(cache: Path, monkeypatch):
    builds: list[str] = []

    def slow_build(compiler: str) -> Path:
        time.sleep(0.5)
        builds.append(compiler)
        return cache / "built.so"

    monkeypatch.setattr(kernel_build, "build", slow_build)
    monkeypatch.setattr(kernel_build, "_outcome", None)  # this process's build, made again
    monkeypatch.setenv("CXX", shutil.which("true") or "true")
    kernel_build.start_early()
    assert kernel_build.built_library() == cache / "built.so"  # waited for the thread's build
    assert kernel_build.built_library() == cache / "built.so"
    assert len(builds) == 1


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
