"""The jax platform settled before jax starts: a quiet CUDA plugin without a GPU, one line when a GPU is
asked for and missing, and a CLI start with no traceback on a machine without a GPU."""

import os
import subprocess
import sys

import pytest

from jaxserve import platform
from jaxserve.platform import SKIP_CUDA_CHECK_ENV, GpuNotFoundError, nvidia_gpu_visible, prepare_jax_platform


@pytest.fixture
def gpu_nodes(monkeypatch, tmp_path):
    """Stands in for the machine's device nodes: `present(name)` makes one appear."""
    nvidia = tuple(str(tmp_path / name) for name in ("nvidia0", "nvidiactl"))
    monkeypatch.setattr(platform, "NVIDIA_DEVICE_NODES", nvidia)
    monkeypatch.setattr(platform, "AMD_DEVICE_NODES", (str(tmp_path / "kfd"),))

    def present(name: str) -> None:
        (tmp_path / name).touch()

    return present


def test_without_a_gpu_the_cuda_check_is_skipped_and_the_platform_left_to_jax(gpu_nodes):
    environ: dict[str, str] = {}
    prepare_jax_platform(environ)
    assert environ == {SKIP_CUDA_CHECK_ENV: "1"}
    environ = {"JAX_PLATFORMS": "cuda,cpu"}  # a GPU if there is one: jax falls back quietly
    prepare_jax_platform(environ)
    assert environ == {"JAX_PLATFORMS": "cuda,cpu", SKIP_CUDA_CHECK_ENV: "1"}


def test_with_a_gpu_nothing_changes(gpu_nodes):
    gpu_nodes("nvidiactl")
    for environ in ({}, {"JAX_PLATFORMS": "cuda"}, {"JAX_PLATFORMS": "cpu"}):
        before = dict(environ)
        prepare_jax_platform(environ)
        assert environ == before


def test_a_gpu_asked_for_and_missing_is_one_line(gpu_nodes):
    with pytest.raises(GpuNotFoundError, match=r"^JAX_PLATFORMS=cuda asks for a GPU, and none is visible here "
                                               r"\(no .*nvidia0, .*nvidiactl\); unset JAX_PLATFORMS"):
        prepare_jax_platform({"JAX_PLATFORMS": "cuda"})
    with pytest.raises(GpuNotFoundError, match="kfd"):
        prepare_jax_platform({"JAX_PLATFORMS": "gpu"})
    gpu_nodes("kfd")  # an AMD GPU serves JAX_PLATFORMS=gpu
    prepare_jax_platform({"JAX_PLATFORMS": "gpu"})


def _cli(*argv: str, **env: str) -> subprocess.CompletedProcess:
    """`python -m jaxserve ARGV` with JAX_PLATFORMS and the CUDA switch as a user's shell has them (unset)."""
    inherited = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", SKIP_CUDA_CHECK_ENV)}
    return subprocess.run([sys.executable, "-m", "jaxserve", *argv], capture_output=True, text=True, timeout=180,
                          env={**inherited, **env})


@pytest.mark.skipif(nvidia_gpu_visible(), reason="a start on a machine without a GPU")
def test_a_start_without_a_gpu_logs_no_traceback():
    # --max-model-len 0 fails after the preset is chosen (jax's backends started) and before any load.
    # Nothing else is written: no traceback of the CUDA check, no line of the plugin's extensions
    # ("cudart_stub.cc:31] Could not find cuda drivers") at `import jax` or at the backend's start.
    result = _cli("generate", "--prompt", "hi", "--max-model-len", "0")
    assert result.returncode == 1
    assert result.stderr.splitlines() == ["jaxserve: error: max_model_len must be >= 1, or -1 for auto, got 0"], (
        result.stderr)


@pytest.mark.skipif(nvidia_gpu_visible(), reason="a start on a machine without a GPU")
def test_the_python_api_starts_without_a_traceback_too():
    # Three devices for tensor parallelism fail once jax's backends have started, before any weight is drawn.
    inherited = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", SKIP_CUDA_CHECK_ENV)}
    code = ("from jaxserve import LLM\ntry:\n    LLM(model='smollm2-135m', load_format='dummy', "
            "tensor_parallel_size=3)\nexcept ValueError as e:\n    print(e)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=inherited)
    assert result.returncode == 0 and "needs 3 devices; this process sees 1" in result.stdout, result.stderr
    assert result.stderr == "", result.stderr


@pytest.mark.skipif(nvidia_gpu_visible(), reason="needs a machine without a GPU")
def test_the_cli_says_in_one_line_that_the_gpu_asked_for_is_missing():
    result = _cli("generate", "--prompt", "hi", JAX_PLATFORMS="cuda")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("jaxserve: error: JAX_PLATFORMS=cuda asks for a GPU, and none is visible")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_two_cuda_plugins_installed_are_named_in_one_warning(tmp_path, monkeypatch, caplog, gpu_nodes):
    """jax starts one CUDA plugin, and with both installed it logs a traceback at every start: jaxserve names
    the two and what to uninstall, once a command, and says nothing with one. (Stand-in packages: jax never imports
    them, only the warning looks for them.)"""
    for module in ("jax_cuda12_plugin", "jax_cuda13_plugin"):
        (tmp_path / module).mkdir()
        (tmp_path / module / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    environ = {}
    with caplog.at_level("WARNING", logger="jaxserve.platform"):
        prepare_jax_platform(environ)
        prepare_jax_platform(dict(environ))  # a child process of the same command
    (record,) = caplog.records
    assert "CUDA 12 and 13 plugins are installed together" in record.getMessage()
    assert "pip uninstall jax-cuda12-plugin jax-cuda12-pjrt" in record.getMessage()
    caplog.clear()
    monkeypatch.setattr(platform, "CUDA_PLUGINS", {13: platform.CUDA_PLUGINS[13]})
    with caplog.at_level("WARNING", logger="jaxserve.platform"):
        prepare_jax_platform({})
    assert platform.installed_cuda_plugins() == [13] and not caplog.records


def test_the_gpu_pool_is_set_before_a_backend_starts_and_left_alone_after():
    """`pool_gpu_memory` (serve's and `LLM`'s --gpu-memory-utilization) sets JAX's pool fraction while no
    backend has started; after, JAX's pool is what it is, so the variable (which the KV budget reads as the
    pool's size) is not set to a figure JAX never took. In fresh processes: the test's has started jax."""
    inherited = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
    code = ("import os, sys\nfrom jaxserve.device import pool_gpu_memory\n"
            "if sys.argv[1] == 'after':\n    import jax\n    jax.devices()\n"
            "pool_gpu_memory(0.5)\nprint(os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION'))")
    for when, expected in (("before", "0.5"), ("after", "None")):
        result = subprocess.run([sys.executable, "-c", code, when], capture_output=True, text=True, timeout=120,
                                env=inherited)
        assert result.returncode == 0 and result.stdout.split() == [expected], (when, result.stdout, result.stderr)
