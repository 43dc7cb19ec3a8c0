"""ModelRunner's KV budget on a GPU, with a GPU's memory statistics stood in: the pages are what
utilization x device memory leaves after the weights, the penalty tables and the step's temp memory,
which comes from compiling the largest buckets (here for the CPU, the path is the same)."""

from jaxserve.config import CacheConfig
from jaxserve.runner.kv_budget import ALLOCATOR_SLACK_BYTES
from jaxserve.runner.penalties import PenaltyTables

GIB = 2**30


def test_the_pages_fill_what_the_utilization_leaves(engine, monkeypatch):
    runner = engine.runner
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # what `serve` sets for utilization 0.9
    device_memory = 80 * GIB
    stats = {"bytes_limit": int(device_memory * 0.9), "bytes_in_use": 3 * GIB}  # weights, as loaded
    temps: list[int] = []
    original = runner._peak_temp_bytes
    monkeypatch.setattr(runner, "_peak_temp_bytes", lambda device: temps.append(original(device)) or temps[-1])
    page_bytes = 2**20

    num_pages = runner._num_kv_pages(CacheConfig(gpu_memory_utilization=0.9), page_bytes, stats)

    assert temps and temps[0] > 0  # XLA's memory analysis of the largest buckets
    penalties = PenaltyTables.num_bytes(runner.max_num_seqs, runner.model.cfg.vocab_size)
    pool = stats["bytes_limit"]  # JAX's pool is exactly the 90% the budget may use
    free = pool - 3 * GIB - penalties - temps[0] - ALLOCATOR_SLACK_BYTES
    assert abs(num_pages - free // page_bytes) <= 1  # float rounding of 80 GiB x 0.9 / 0.9
    assert runner._num_kv_pages(CacheConfig(num_kv_pages=7), page_bytes, stats) == 7  # an explicit count wins
