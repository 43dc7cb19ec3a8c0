"""The GPU memory budget: --gpu-memory-utilization is a fraction of the device's memory, as in vLLM."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxserve.device import deviceless_devices
from jaxserve.models.features import FeaturePages
from jaxserve.parallel import TP_AXIS
from jaxserve.runner.aot import page_bytes_on_device, step_shapes
from jaxserve.runner.kv_budget import ALLOCATOR_SLACK_BYTES, KVBudget, budget_from_memory_stats, pages_in_host_memory

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


class _Llama3_8B:
    num_layers, num_kv_heads, head_dim, vocab_size = 32, 8, 128, 128256


def test_a_page_holds_k_and_v_of_every_layer_and_a_device_its_share():
    """Llama-3-8B in bf16: 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes = 128 KiB a token, alone; over
    two GPUs each holds half (the KV heads split), and whole a page of hidden states whose width does not split
    (replicated, as `page_array_sharding` places it), half one whose width does."""
    devices = deviceless_devices("h100", 2)
    mesh = Mesh(np.asarray(devices), (TP_AXIS,))
    plain = step_shapes(_Llama3_8B, jnp.bfloat16, 16, 100, 8, 4)
    assert page_bytes_on_device(plain, devices[0]) == 16 * 128 * 1024
    assert page_bytes_on_device(plain, devices[0], mesh) == 16 * 64 * 1024
    for width, share in ((4096, 2048), (4095, 4095)):
        kept = step_shapes(_Llama3_8B, jnp.bfloat16, 16, 100, 8, 4, features=FeaturePages(width, jnp.bfloat16))
        assert page_bytes_on_device(kept, devices[0], mesh) == 16 * 64 * 1024 + 16 * share * 2


def test_a_cpu_budget_is_the_host_s_memory_that_every_device_s_share_takes_from():
    """--kv-cache-memory on CPUs is the host's memory: at TP=2 each page takes its share twice, so the count is
    that of the whole page, whichever device counts it."""
    assert pages_in_host_memory(1.0, 2**20, 1) == 1024
    assert pages_in_host_memory(1.0, 2**19, 2) == 1024
    assert pages_in_host_memory(1.5, 3 * 2**19, 2) == 512
