"""What each data-parallel rank's process may use: its GPUs, or on a CPU its share of the cores (pure Python,
no jax).

A rank's process takes its placement (`RankPlacement.apply`) before jax starts a backend, so that jax sees
only what is the rank's:
- On NVIDIA GPUs, CUDA_VISIBLE_DEVICES lists the rank's `tensor_parallel_size` GPUs, a slice of those the
  frontend sees (its own CUDA_VISIBLE_DEVICES, else every /dev/nvidiaN). A rank that saw every GPU would
  pool memory on all of them.
- On a CPU, every thread of the rank's process is pinned to whole physical cores (SMT siblings together,
  in package and core order, so a rank stays within one socket where it can). XLA's thread pools, and the
  native kernels that share them, size themselves from the process's affinity, so the ranks do not
  contend for cores.
  Fewer physical cores than ranks: no pinning.
Other accelerators (a TPU, an AMD GPU) are not placed: a data-parallel engine refuses to start there.
"""

import contextlib
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from jaxserve.platform import cpu_backend_expected, nvidia_gpu_visible

logger = logging.getLogger(__name__)

_SYSFS_CPUS = Path("/sys/devices/system/cpu")


@dataclass(frozen=True)
class RankPlacement:
    rank: int
    num_ranks: int
    gpus: tuple[str, ...] | None = None  # CUDA_VISIBLE_DEVICES entries; None: not on GPUs
    cpus: frozenset[int] | None = None  # the CPUs the process may run on; None: the parent's

    def apply(self) -> None:
        """Takes the placement in this process; call before jax starts a backend."""
        if self.gpus is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
        if self.cpus is not None:
            # Every thread the process has already (numpy's BLAS pool starts at import), and with them all
            # that later start (XLA's pools), which inherit it.
            for thread in Path("/proc/self/task").iterdir():
                with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                    os.sched_setaffinity(int(thread.name), self.cpus)
        logger.info("data-parallel rank %d of %d: %s", self.rank, self.num_ranks, self.describe())

    def describe(self) -> str:
        if self.gpus is not None:
            return f"GPUs {','.join(self.gpus)}"
        if self.cpus is not None:
            return f"CPUs {_ranges(self.cpus)}"
        return "the CPUs of the frontend's process (fewer physical cores than ranks)"


def placements(num_ranks: int, devices_per_rank: int, environ: Mapping[str, str] = os.environ,
               cpus: Iterable[int] | None = None, sysfs: Path = _SYSFS_CPUS) -> list[RankPlacement]:
    """Each rank's placement. `cpus`: those this process may run on (its affinity by default)."""
    if not cpu_backend_expected(environ):
        if not nvidia_gpu_visible():
            raise ValueError("--data-parallel-size places its ranks on NVIDIA GPUs or on a CPU; this machine's "
                             "jax backend is neither (JAX_PLATFORMS=cpu serves on the CPU)")
        gpus = visible_gpus(environ)
        if len(gpus) < num_ranks * devices_per_rank:
            raise ValueError(f"--data-parallel-size {num_ranks} x --tensor-parallel-size {devices_per_rank} needs "
                             f"{num_ranks * devices_per_rank} GPUs; {len(gpus)} are visible ({', '.join(gpus)})")
        return [RankPlacement(rank, num_ranks, gpus=tuple(gpus[rank * devices_per_rank:(rank + 1) * devices_per_rank]))
                for rank in range(num_ranks)]
    cores = physical_cores(os.sched_getaffinity(0) if cpus is None else cpus, sysfs)
    if len(cores) < num_ranks:
        logger.warning("%d data-parallel ranks on %d physical cores: the ranks share them", num_ranks, len(cores))
        return [RankPlacement(rank, num_ranks) for rank in range(num_ranks)]
    share, extra = divmod(len(cores), num_ranks)
    result, start = [], 0
    for rank in range(num_ranks):
        end = start + share + (rank < extra)
        result.append(RankPlacement(rank, num_ranks, cpus=frozenset(cpu for core in cores[start:end] for cpu in core)))
        start = end
    return result


def visible_gpus(environ: Mapping[str, str] = os.environ, dev: Path = Path("/dev")) -> list[str]:
    """The NVIDIA GPUs this process sees, as CUDA_VISIBLE_DEVICES entries: its own list (indices or UUIDs),
    else CUDA's ordinals 0..n-1 for the n /dev/nvidiaN nodes (a container's nodes keep the host's numbers,
    which are not CUDA's ordinals)."""
    if (listed := environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        return [entry.strip() for entry in listed.split(",") if entry.strip()]
    count = sum(1 for node in dev.glob("nvidia*") if re.fullmatch(r"nvidia\d+", node.name))
    return [str(index) for index in range(count)]


def physical_cores(cpus: Iterable[int], sysfs: Path = _SYSFS_CPUS) -> list[list[int]]:
    """`cpus` grouped by physical core (SMT siblings together, as the kernel lists them), the cores in
    (package, first CPU) order. A CPU whose topology cannot be read counts as a core of its own."""
    groups: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(cpus):
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            siblings = parse_cpu_list((topology / "thread_siblings_list").read_text())
            key = (int((topology / "physical_package_id").read_text()), min(siblings | {cpu}))
        except (OSError, ValueError):
            key = (-1, cpu)
        groups.setdefault(key, []).append(cpu)
    return [groups[key] for key in sorted(groups)]


def parse_cpu_list(text: str) -> set[int]:
    """The kernel's CPU list format: '0-3,8,10-11'."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _ranges(cpus: Iterable[int]) -> str:
    """1,2,3,7 -> '1-3,7'."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
