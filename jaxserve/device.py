"""Device facts: the one answer to "what is the step compiled for?", from the local device or a GPU target.

Every device question the engine asks reads a `DeviceFacts`: which attention implementation `auto` picks
(the CUDA compute capability), how many programs the decode kernel splits a request into (the SM count),
how much memory the KV cache may take, and the roofline figures (peak matmul rate, memory bandwidth).
Nothing else calls `jax.devices()` to ask, so compiling for an H100 on a CPU-only machine picks exactly
what a real H100 would.

A named target is an XLA `GpuTargetConfigProto` (`jaxserve/targets/*.txtpb`, copied from openxla/xla's
`xla/backends/gpu/target_config/specs/`) plus the dense tensor-core peaks NVIDIA publishes, which those
descriptions do not carry. `deviceless_device(target)` gives a jax device of that kind with no GPU present
(XLA's ahead-of-time compilation: Triton and ptxas run, nothing executes).
"""

import functools
import importlib.resources
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class DeviceFacts:
    name: str  # "NVIDIA H100 80GB HBM3", "cpu"
    platform: str  # "gpu", "cpu", "tpu"
    compute_capability: float | None = None  # CUDA only: 9.0 on an H100
    num_sms: int | None = None  # streaming multiprocessors (GPU cores)
    memory_bytes: int | None = None  # the device's whole memory; None when it does not say
    memory_bandwidth: float | None = None  # bytes/s
    # dtype name -> dense matmul flop/s (bf16 on tensor cores; float32 as TF32, XLA's default on GPUs)
    peak_flops: tuple[tuple[str, float], ...] = field(default=())
    target: str | None = None  # the TARGETS key when this describes a compile target, not a local device

    def peak_flops_for(self, dtype: str) -> float | None:
        return dict(self.peak_flops).get(dtype)


@dataclass(frozen=True)
class DataSheet:
    """A GPU's figures from its vendor's data sheet, lent to a local device whose name matches."""

    name_pattern: str  # matches jax's device_kind of the real device
    memory_bandwidth: float  # bytes/s
    peak_flops: tuple[tuple[str, float], ...]  # dense (not 2:4 sparse) tensor-core peaks


DATA_SHEETS: dict[str, DataSheet] = {
    "h100": DataSheet(r"H100.*(SXM|HBM3)", 3.35e12,
                      (("bfloat16", 989.4e12), ("float32", 494.7e12), ("float8_e4m3fn", 1978.9e12))),
    "h200": DataSheet(r"H200", 4.8e12,
                      (("bfloat16", 989.4e12), ("float32", 494.7e12), ("float8_e4m3fn", 1978.9e12))),
    "a100": DataSheet(r"A100.*80GB", 2.039e12, (("bfloat16", 312e12), ("float32", 156e12))),
    "l40s": DataSheet(r"L40S", 0.864e12,
                      (("bfloat16", 362.05e12), ("float32", 183.2e12), ("float8_e4m3fn", 733e12))),
}


@dataclass(frozen=True)
class GpuTarget:
    spec_file: str  # in jaxserve/targets/: XLA's description of the GPU, for deviceless compiles
    sheet: DataSheet

    @property
    def peak_flops(self) -> tuple[tuple[str, float], ...]:
        return self.sheet.peak_flops


TARGETS: dict[str, GpuTarget] = {
    "h100": GpuTarget("h100_sxm.txtpb", DATA_SHEETS["h100"]),
    "a100": GpuTarget("a100_sxm_80.txtpb", DATA_SHEETS["a100"]),
    "l40s": GpuTarget("l40s.txtpb", DATA_SHEETS["l40s"]),
}


def target_spec_text(target: str) -> str:
    if target not in TARGETS:
        raise ValueError(f"unknown GPU target {target!r}; choose from {', '.join(sorted(TARGETS))}")
    return (importlib.resources.files("jaxserve") / "targets" / TARGETS[target].spec_file).read_text()


def _proto_field(text: str, name: str) -> str | None:
    match = re.search(rf"^\s*{name}:\s*\"?([^\"\n]+)\"?\s*$", text, re.MULTILINE)
    return match.group(1) if match else None


def target_facts(target: str) -> DeviceFacts:
    """The facts of a named GPU target, read from its XLA description (no jax needed)."""
    text = target_spec_text(target)
    capability = re.search(r"cuda_compute_capability\s*{([^}]*)}", text)
    major = _proto_field(capability.group(1), "major") if capability else None
    minor = _proto_field(capability.group(1), "minor") if capability else None
    return DeviceFacts(
        name=_proto_field(text, "device_description_str") or target,
        platform="gpu",
        compute_capability=float(f"{major}.{minor or 0}") if major else None,
        num_sms=int(_proto_field(text, "core_count") or 0) or None,
        memory_bytes=int(_proto_field(text, "device_memory_size") or 0) or None,
        memory_bandwidth=float(_proto_field(text, "memory_bandwidth") or 0) or None,
        peak_flops=TARGETS[target].peak_flops,
        target=target,
    )


def local_facts(device: Any = None) -> DeviceFacts:
    """The facts of a local jax device (the default one): what `jaxserve serve` runs on."""
    import jax

    device = device or jax.devices()[0]
    kind = str(getattr(device, "device_kind", device.platform))
    capability = None
    if device.platform == "gpu":
        try:
            capability = float(device.compute_capability)
        except (AttributeError, TypeError, ValueError):  # ROCm reports a gfx name
            capability = None
    known = next((sheet for sheet in DATA_SHEETS.values() if re.search(sheet.name_pattern, kind)), None)
    return DeviceFacts(
        name=kind,
        platform=device.platform,
        compute_capability=capability,
        num_sms=getattr(device, "core_count", None) if device.platform == "gpu" else None,
        memory_bytes=None,
        memory_bandwidth=known.memory_bandwidth if known else None,
        peak_flops=known.peak_flops if known else (),
    )


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This x86 CPU's feature flags, as /proc/cpuinfo lists them (`avx2`, `avx512f`, ...); empty elsewhere."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return frozenset(next((line for line in cpuinfo if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def cpu_has_bf16_dots() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX-BF16, from /proc/cpuinfo's
    flags): where 16-bit weights and KV cache are the fast default (`loader.resolve_weight_dtype`)."""
    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})


def deviceless_device(target: str) -> Any:
    """A jax device of the target's kind on a machine without it: compiles run XLA:GPU, Triton and ptxas.

    The process's own platform must be the CPU (set before jax starts a backend), or the CUDA plugin
    looks for a driver; `use_cpu_platform()` does that.
    """
    return deviceless_devices(target, 1)[0]


# Without an allocator to ask (deviceless), XLA:GPU takes this fraction of the device's memory as the limit
# its scheduler and rematerialization work to; on a GPU, jaxlib passes the allocator pool's size instead.
XLA_DEVICELESS_MEMORY_FRACTION = 0.8


def deviceless_devices(target: str, count: int, allocator_pool_bytes: int | None = None) -> list[Any]:
    """`count` devices of the target's kind in one host (an 8-GPU H100 node for count 8), deviceless.

    `allocator_pool_bytes`: the memory limit a real GPU's compile gets (its allocator pool: serve's
    --gpu-memory-utilization of the device), given to XLA as the device's memory over its deviceless
    fraction. Otherwise a KV cache budgeted beyond 80% of the device exceeds XLA's limit, and
    rematerialization and copies rework the step (docs/benchmarks.md)."""
    from jax.experimental import topologies

    spec = target_spec_text(target)
    if allocator_pool_bytes is not None:
        memory = int(allocator_pool_bytes / XLA_DEVICELESS_MEMORY_FRACTION)
        spec = re.sub(r"(device_memory_size:\s*)\d+", lambda m: f"{m.group(1)}{memory}", spec)
    topology = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{count}", target_config=spec)
    return list(topology.devices)


def use_cpu_platform() -> None:
    """Makes the CPU the process's jax platform (deviceless compiles need it); a no-op once set."""
    import jax

    jax.config.update("jax_platforms", "cpu")


# JAX's allocator pools this fraction of a GPU's memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise.
JAX_DEFAULT_POOL_FRACTION = 0.75


def device_memory_stats(device: Any) -> dict[str, int] | None:
    """The allocator's statistics on an accelerator (`bytes_limit`, what the KV budget divides;
    `bytes_in_use`); None on a CPU, which keeps none (its KV cache --kv-cache-memory sizes)."""
    return None if device.platform == "cpu" else device.memory_stats()


def allocator_pool_fraction() -> float:
    """The fraction of GPU memory JAX's allocator pools in this process."""
    return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_DEFAULT_POOL_FRACTION))


def _backend_started() -> bool:
    """Whether this process has started a JAX backend (without importing jax where it has not been)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge  # JAX's own record; no public API says it

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return started() if started is not None else bool(getattr(xla_bridge, "_backends", None))


def pool_gpu_memory(utilization: float) -> None:
    """Lets JAX's allocator pool `utilization` of GPU memory, the share `--gpu-memory-utilization` gives
    jaxserve (JAX's default pool is 75%, so the KV budget could not use more). A user's own
    XLA_PYTHON_CLIENT_MEM_FRACTION wins. Only effective before jax starts a backend: after (an `LLM` made in
    a process that has used jax), the pool stays what it is, and so does the variable, which the KV budget
    reads as the pool's size (`allocator_pool_fraction`)."""
    if _backend_started():
        return
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{utilization:g}")
