"""The GPU memory budget: --gpu-memory-utilization is a fraction of the device's memory, as in vLLM."""

import pytest

from jaxserve.runner.kv_budget import ALLOCATOR_SLACK_BYTES, KVBudget, budget_from_memory_stats, bytes_per_page

GIB = 2**30


def test_the_kv_cache_gets_utilization_x_memory_minus_weights_temp_and_state():
    budget = KVBudget(
        device_memory_bytes=80 * GIB, utilization=0.9, weights_bytes=16 * GIB, state_bytes=GIB // 4,
        peak_temp_bytes=2 * GIB, bytes_per_page=2 * 2**20,
    )
    want = int(80 * GIB * 0.9) - 16 * GIB - GIB // 4 - 2 * GIB - ALLOCATOR_SLACK_BYTES
    assert budget.kv_bytes == want
    assert budget.num_pages == want // (2 * 2**20)
    budget.check()


def test_live_stats_give_the_device_memory_through_the_allocator_pool():
    """JAX pools `pool_fraction` of the device; with the pool set to the utilization (as `serve` does),
    the whole pool minus what is in use and the step's temp memory goes to pages."""
    device = 80 * GIB
    stats = {"bytes_limit": int(device * 0.9), "bytes_in_use": 5 * GIB}
    budget = budget_from_memory_stats(stats, pool_fraction=0.9, utilization=0.9, state_bytes=0,
                                      peak_temp_bytes=GIB, bytes_per_page=2**20)
    assert budget.device_memory_bytes == pytest.approx(device, abs=16)
    assert budget.kv_bytes == pytest.approx(device * 0.9 - 6 * GIB - ALLOCATOR_SLACK_BYTES, abs=16)


def test_a_smaller_allocator_pool_caps_the_budget():
    """JAX's default pool is 75%: asking for 90% cannot take more than the pool holds."""
    device = 80 * GIB
    stats = {"bytes_limit": int(device * 0.75), "bytes_in_use": 0}
    budget = budget_from_memory_stats(stats, pool_fraction=0.75, utilization=0.9, state_bytes=0,
                                      peak_temp_bytes=0, bytes_per_page=2**20)
    assert budget.pool_bytes == int(device * 0.75)


def test_no_room_says_where_the_memory_went():
    budget = KVBudget(device_memory_bytes=24 * GIB, utilization=0.5, weights_bytes=15 * GIB, state_bytes=0,
                      peak_temp_bytes=GIB, bytes_per_page=2**20)
    assert budget.num_pages == 0
    with pytest.raises(ValueError, match=r"weights take 15.00 GiB.*raise --gpu-memory-utilization"):
        budget.check()


def test_a_page_holds_k_and_v_of_every_layer():
    # Llama-3-8B in bf16: 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes = 128 KiB per token.
    assert bytes_per_page(32, 8, 16, 128, 2) == 16 * 128 * 1024
