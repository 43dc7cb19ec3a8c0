"""The allocator: which library JAXSERVE_ALLOCATOR picks, and the re-execution that preloads it, run for real
in subprocesses (same PID, same arguments, tcmalloc mapped afterwards, never twice)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve import allocator
from jaxserve.allocator import _REEXECUTED_ENV, ALLOCATOR_ENV, find_tcmalloc

TCMALLOC = find_tcmalloc() if os.environ.get(ALLOCATOR_ENV) != "glibc" else None
needs_tcmalloc = pytest.mark.skipif(TCMALLOC is None, reason="no tcmalloc here (`make setup` fetches one with apt)")

# Preloads, then prints what it runs under; `sys.argv[1:]` shows the arguments survive the re-execution.
PROBE = ("import os, sys\n"
         "from jaxserve.allocator import loaded_allocator, preload_tcmalloc\n"
         "preload_tcmalloc()\n"
         "print(os.getpid(), loaded_allocator(), *sys.argv[1:])\n")


def _clean_env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items()
            if key not in (ALLOCATOR_ENV, "LD_PRELOAD", _REEXECUTED_ENV)}


def _probe(setting: str | None, *args: str, returncode: int = 0, **env: str) -> tuple[subprocess.Popen, str, str]:
    env = {**_clean_env(), **env}
    if setting is not None:
        env[ALLOCATOR_ENV] = setting
    process = subprocess.Popen([sys.executable, "-c", PROBE, *args], env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == returncode, stderr
    return process, stdout, stderr


def test_the_setting_picks_the_library(monkeypatch, tmp_path):
    monkeypatch.setenv(ALLOCATOR_ENV, "glibc")
    assert find_tcmalloc() is None
    library = tmp_path / "libmine.so"
    library.write_bytes(b"")
    monkeypatch.setenv(ALLOCATOR_ENV, str(library))
    assert find_tcmalloc() == library
    monkeypatch.setenv(ALLOCATOR_ENV, str(tmp_path / "missing.so"))
    with pytest.raises(ValueError, match="no such file"):
        find_tcmalloc()


def test_found_in_the_environment_first_and_required_when_asked(monkeypatch, tmp_path):
    monkeypatch.setattr(allocator, "_SYSTEM_DIRS", ())
    monkeypatch.setattr(allocator, "venv_library_dir", lambda: tmp_path)
    monkeypatch.delenv(ALLOCATOR_ENV, raising=False)
    assert find_tcmalloc() is None  # nothing anywhere: glibc serves, quietly
    monkeypatch.setenv(ALLOCATOR_ENV, "tcmalloc")
    with pytest.raises(ValueError, match="none found"):
        find_tcmalloc()
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert find_tcmalloc() == tmp_path / "libtcmalloc_minimal.so.4"


@needs_tcmalloc
def test_the_process_re_executes_itself_with_tcmalloc():
    process, stdout, _ = _probe(None, "--model", "two words")
    pid, name, *args = stdout.split()
    assert name == "tcmalloc"
    assert int(pid) == process.pid  # exec, not a child: signals and waits reach the same process
    assert args == ["--model", "two", "words"]


def test_glibc_when_asked():
    _, stdout, _ = _probe("glibc")
    assert stdout.split()[1] == "glibc"


def test_a_library_named_that_fails_to_load_is_an_error_not_a_loop(tmp_path):
    broken = tmp_path / "libtcmalloc_broken.so"
    broken.write_text("not an ELF file")
    _, stdout, stderr = _probe(str(broken), returncode=1)
    assert stdout == ""  # one re-execution, the loader's complaint, then the error
    assert "cannot be preloaded" in stderr and "the library could not be preloaded" in stderr


@needs_tcmalloc
def test_glibc_when_asked_even_under_an_inherited_preload():
    """A child of a process that preloaded tcmalloc inherits it; JAXSERVE_ALLOCATOR=glibc takes it out."""
    process, stdout, _ = _probe("glibc", **{"LD_PRELOAD": str(TCMALLOC), _REEXECUTED_ENV: "1"})
    pid, name = stdout.split()
    assert name == "glibc" and int(pid) == process.pid


@needs_tcmalloc
def test_a_python_call_of_the_cli_never_re_executes(tmp_path):
    code = ("import os\n"
            "from jaxserve.cli import main\n"
            "from jaxserve.allocator import loaded_allocator\n"
            "try:\n"
            "    main(['generate', '--model', '/nonexistent/model'])\n"
            "except SystemExit:\n"
            "    pass\n"
            "print(loaded_allocator())\n")
    result = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).parent)
    assert result.stdout.split()[-1] == "glibc", result.stderr


def _imports(*args: str) -> list[str]:
    """The modules `python -m jaxserve ARGS` imports, in every process it runs as (one line each)."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "jaxserve", *args], env=_clean_env(),
                            capture_output=True, text=True, timeout=120)
    return [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")]


@needs_tcmalloc
def test_a_step_command_starts_again_before_the_cli_is_imported():
    """The first process of `jaxserve generate` imports the allocator, not the CLI's modules: starting again
    costs an interpreter's start. A command that runs no steps is not started again."""
    imports = _imports("generate", "--help")
    assert imports.count("jaxserve.allocator") == 2  # two processes, the same PID
    assert imports.count("jaxserve.cli") == 1  # in the second alone
    imports = _imports("compile", "--help")
    assert imports.count("jaxserve.allocator") == 1 and imports.count("jaxserve.cli") == 1


def test_the_commands_that_run_steps():
    assert allocator.runs_steps(["serve", "--model", "gpt2"]) and allocator.runs_steps(["generate"])
    assert allocator.runs_steps(["bench", "offline", "--concurrency", "1"])
    assert allocator.runs_steps(["bench", "buckets"])
    assert not allocator.runs_steps(["bench"]) and not allocator.runs_steps(["compile", "--target", "h100"])
    assert not allocator.runs_steps([]) and not allocator.runs_steps(["--version"])
