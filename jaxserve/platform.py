"""A quiet start on a machine without a GPU, and one line where a GPU was asked for and is not there.

Why. The `gpu-compile` and `test` extras install JAX's CUDA PJRT plugin, so that a CPU machine can compile
for GPUs (`jaxserve compile --target h100`). When jax starts its first backend it initialises every
plugin, and the CUDA plugin first checks the CUDA runtime's version. With no NVIDIA driver that check
raises "Unable to load CUDA. Is it installed?", which jax logs with two chained tracebacks
(`logger.exception` in `jax._src.xla_bridge.discover_pjrt_plugins`, jax 0.10) before it carries on on the
CPU (newer plugins log a warning instead). Every process that starts a backend does it again: the server,
its engine core, the preset probe.

How. `prepare_jax_platform()` runs before jax starts a backend (the CLI calls it before running a
command). Where no NVIDIA GPU is visible (none of the device nodes jax itself looks for before starting
CUDA, `jax._src.hardware_utils.has_visible_nvidia_gpu`) it sets JAX_SKIP_CUDA_CONSTRAINTS_CHECK, the
plugin's own switch for that check, in the environment, so child processes inherit it. jax then skips
CUDA as it would anyway (no GPU is visible), registers the plugin for deviceless compiles, and starts
every other platform (the CPU, a TPU) as before. Where a GPU is visible nothing changes, so a broken CUDA
install on a GPU machine still shows jax's full report. Where JAX_PLATFORMS asks for nothing but a GPU
and none is visible, it raises `GpuNotFoundError` with one line, instead of jax's tracebacks and bare
AssertionError.

Not chosen: JAX_PLATFORMS=cpu where no NVIDIA GPU is visible (it would also hide a TPU or an AMD GPU),
and a logging filter on jax's private logger (the failing check still runs, and a filter on a message's
wording stops working silently when jax rewords it).

The other noise, at `import jax` and at the backend's start: each of the plugin's C++ extensions (jaxlib's
gpu_solver, gpu_prng, gpu_linalg, then the PJRT plugin) prints `cudart_stub.cc:31] Could not find cuda
drivers on your machine` with absl's "All log messages before absl::InitializeLog()" banner: eight lines.
It is the CUDA runtime library they fail to find, not the driver, and no variable turns the lines off
(TF_CPP_MIN_LOG_LEVEL does not). So the `gpu-compile` extra installs the runtime (nvidia-cuda-runtime,
CUDA 13's, 2.4 MB, the package `jax[cuda13]` brings on a GPU machine): the extensions load it and say
nothing, and with the version check skipped nothing calls it without a GPU.

jax starts one CUDA plugin. With both the CUDA 12 and the CUDA 13 one installed (an older gpu-compile extra
upgraded in place, or `jaxserve[cuda12]` beside the test extra), the second one's registration fails and jax
logs its traceback ("PJRT_Api already exists for device type cuda") at every start, GPU or not; which CUDA
then compiles can change from one process to the next. `prepare_jax_platform()` says so in one line, with
what to uninstall, once a command (its child processes do not repeat it).
"""

import importlib.util
import logging
import os
from collections.abc import Mapping, MutableMapping

logger = logging.getLogger(__name__)

# The nodes jax checks (jax._src.hardware_utils._NVIDIA_GPU_DEVICES): a GPU, Docker's control node, WSL2.
NVIDIA_DEVICE_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")
AMD_DEVICE_NODES = ("/dev/kfd",)  # ROCm's kernel driver
SKIP_CUDA_CHECK_ENV = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"
CUDA_PLUGINS_NAMED_ENV = "JAXSERVE_CUDA_PLUGINS_NAMED"  # set once the warning below is given
# jax's CUDA plugins by CUDA major version: their modules, and the packages that uninstall one.
CUDA_PLUGINS = {12: ("jax_cuda12_plugin", "jax-cuda12-plugin jax-cuda12-pjrt"),
                13: ("jax_cuda13_plugin", "jax-cuda13-plugin jax-cuda13-pjrt")}


class GpuNotFoundError(RuntimeError):
    """JAX_PLATFORMS asks for a GPU and this machine shows none."""


def nvidia_gpu_visible() -> bool:
    """Whether jax would try to start its CUDA backend here (it makes the same check)."""
    return any(os.path.exists(node) for node in NVIDIA_DEVICE_NODES)


def gpu_device_nodes(platform: str) -> tuple[str, ...]:
    """The device nodes one of which a JAX_PLATFORMS entry needs; () for platforms that are not GPUs."""
    return {"cuda": NVIDIA_DEVICE_NODES, "rocm": AMD_DEVICE_NODES,
            "gpu": NVIDIA_DEVICE_NODES + AMD_DEVICE_NODES}.get(platform, ())


def requested_platforms(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """JAX_PLATFORMS as a list (jax's own variable); empty when jax may choose."""
    return [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]


def prepare_jax_platform(environ: MutableMapping[str, str] = os.environ) -> None:
    """Call before anything starts a jax backend. Quiets the CUDA plugin where no NVIDIA GPU is visible;
    raises GpuNotFoundError where JAX_PLATFORMS names only GPUs and none of them is visible."""
    requested = requested_platforms(environ)
    nodes = list(dict.fromkeys(node for p in requested for node in gpu_device_nodes(p)))
    only_gpus = bool(requested) and all(gpu_device_nodes(p) for p in requested)
    if only_gpus and not any(os.path.exists(node) for node in nodes):
        raise GpuNotFoundError(
            f"JAX_PLATFORMS={environ['JAX_PLATFORMS']} asks for a GPU, and none is visible here (no "
            f"{', '.join(nodes)}); unset JAX_PLATFORMS to run on the CPU"
        )
    if not nvidia_gpu_visible():
        environ.setdefault(SKIP_CUDA_CHECK_ENV, "1")
    if len(cudas := installed_cuda_plugins()) > 1 and not environ.get(CUDA_PLUGINS_NAMED_ENV):
        environ[CUDA_PLUGINS_NAMED_ENV] = "1"  # once a command: its child processes inherit it
        logger.warning("jax's CUDA %s plugins are installed together, and jax starts one: it logs a traceback at every "
                       "start and may compile with either. Keep one, e.g. `pip uninstall %s` (jaxserve's test "
                       "and gpu-compile extras use CUDA 13)", " and ".join(map(str, cudas)), CUDA_PLUGINS[12][1])


def installed_cuda_plugins() -> list[int]:
    """The CUDA major versions whose jax plugin is installed here (found, not imported)."""
    return [cuda for cuda, (module, _) in CUDA_PLUGINS.items() if importlib.util.find_spec(module) is not None]


def cpu_backend_expected(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether jax will run on the CPU here, judged without importing it: JAX_PLATFORMS puts the CPU first,
    or names nothing while no GPU's device node is visible and no TPU runtime is installed."""
    if requested := requested_platforms(environ):
        return requested[0] == "cpu"
    gpu_nodes = NVIDIA_DEVICE_NODES + AMD_DEVICE_NODES
    return not any(os.path.exists(node) for node in gpu_nodes) and importlib.util.find_spec("libtpu") is None
