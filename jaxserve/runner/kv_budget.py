"""How many KV pages fit: the GPU memory budget, as vLLM defines `--gpu-memory-utilization` (no jax).

The KV cache gets what is left of `utilization x device memory` once the weights, the other state the
step keeps (penalty tables), and the step's peak temp memory (an estimate checked by XLA's memory
analysis of the largest buckets' compiles, with a margin: `kv_sizing.py`) are taken out. JAX's allocator is told to pool
exactly `utilization x device memory` (`XLA_PYTHON_CLIENT_MEM_FRACTION`), so the budget is memory the
process can actually use.
"""

from dataclasses import dataclass

# Kept free inside the pool for the allocator's fragmentation and small buffers (step inputs, outputs).
ALLOCATOR_SLACK_BYTES = 256 * 2**20


def fit_to_kv_cache(max_model_len: int, num_pages: int, page_size: int) -> int:
    """--max-model-len auto's length once the cache is sized: `max_model_len`, or the tokens one request
    can hold where the cache holds fewer (every page but the padding slot's, as the page manager counts)."""
    return min(max_model_len, (num_pages - 1) * page_size)


@dataclass(frozen=True)
class KVBudget:
    device_memory_bytes: int
    utilization: float
    weights_bytes: int
    state_bytes: int  # the step's other persistent arrays (penalty tables)
    peak_temp_bytes: int  # kept for the step's temp memory (`kv_sizing.with_margin` of XLA's figure)
    bytes_per_page: int
    allocator_limit_bytes: int | None = None  # JAX's pool, when a user's XLA_PYTHON_CLIENT_MEM_FRACTION caps it

    @property
    def pool_bytes(self) -> int:
        wanted = int(self.device_memory_bytes * self.utilization)
        return min(wanted, self.allocator_limit_bytes) if self.allocator_limit_bytes else wanted

    @property
    def kv_bytes(self) -> int:
        used = self.weights_bytes + self.state_bytes + self.peak_temp_bytes + ALLOCATOR_SLACK_BYTES
        return max(0, self.pool_bytes - used)

    @property
    def num_pages(self) -> int:
        return self.kv_bytes // self.bytes_per_page

    def check(self) -> None:
        """Raises with the arithmetic when not even two pages fit."""
        if self.num_pages < 2:
            gib = 2**30
            raise ValueError(
                f"no room for a KV cache: {self.utilization:.2f} x {self.device_memory_bytes / gib:.1f} GiB "
                f"of device memory = {self.pool_bytes / gib:.2f} GiB, of which the weights take "
                f"{self.weights_bytes / gib:.2f} GiB, the step's temp memory {self.peak_temp_bytes / gib:.2f} GiB "
                f"and other state {self.state_bytes / gib:.2f} GiB; raise --gpu-memory-utilization, "
                "lower --max-num-seqs or the largest bucket, or use a smaller dtype"
            )


def budget_from_memory_stats(
    stats: dict[str, int],
    pool_fraction: float,
    utilization: float,
    state_bytes: int,
    peak_temp_bytes: int,
    bytes_per_page: int,
) -> KVBudget:
    """The budget on a live GPU, from `device.memory_stats()` once the weights are on it.

    JAX's allocator pools `pool_fraction` of the device (its `bytes_limit`), so the device's memory is
    `bytes_limit / pool_fraction`; everything in use so far counts as weights.
    """
    return KVBudget(
        device_memory_bytes=int(stats["bytes_limit"] / pool_fraction),
        utilization=utilization,
        weights_bytes=int(stats.get("bytes_in_use", 0)),
        state_bytes=state_bytes,
        peak_temp_bytes=peak_temp_bytes,
        bytes_per_page=bytes_per_page,
        allocator_limit_bytes=int(stats["bytes_limit"]),
    )


def pages_in_host_memory(memory_gib: float, page_bytes_on_device: int, num_devices: int) -> int:
    """The pages a KV cache of `memory_gib` GiB (`--kv-cache-memory`) holds on a host whose `num_devices`
    devices' memory is its own (CPUs): a page takes one device's share of it on each device."""
    return int(memory_gib * 2**30 // (page_bytes_on_device * num_devices))
