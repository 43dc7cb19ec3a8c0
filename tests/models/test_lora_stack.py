"""`layers.LoraStack` against a float64 oracle: each token adds its own slot's (x A_s) B_s, a base-model token
(NO_LORA_SLOT) nothing, in float32 and in bfloat16 through `dense`'s paths (the native CPU kernel up to
NATIVE_MATMUL_MAX_ROWS rows, XLA's dot beyond)."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.engine.step_io import NO_LORA_SLOT
from jaxserve.models.layers import LoraShape, LoraStack
from jaxserve.ops import cpu_kernels
from jaxserve.ops.attention import AttentionConfig

K, N, SLOTS, RANK = 48, 40, 3, 8


def _stack(dtype, attention: AttentionConfig, seed: int = 0) -> tuple[LoraStack, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    stack = LoraStack(K, N, LoraShape(SLOTS, RANK), dtype, attention)
    a = rng.normal(size=(K, SLOTS, RANK)).astype(dtype)
    b = rng.normal(size=(SLOTS, RANK, N)).astype(dtype)
    stack.lora_a[...], stack.lora_b[...] = jnp.asarray(a), jnp.asarray(b)
    return stack, a.astype(np.float64), b.astype(np.float64)


def _oracle(x: np.ndarray, slots: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.zeros((x.shape[0], N))
    for t, slot in enumerate(slots):
        if slot != NO_LORA_SLOT:
            out[t] = x[t] @ a[:, slot] @ b[slot]
    return out


def _slots(rows: int) -> np.ndarray:
    return np.array([(NO_LORA_SLOT, 0, 1, 2)[t % 4] for t in range(rows)], np.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
def test_float32_slots_against_float64(rows):
    stack, a, b = _stack(np.float32, AttentionConfig())
    x = np.random.default_rng(1).normal(size=(rows, K)).astype(np.float32)
    slots = _slots(rows)
    got = np.asarray(jax.jit(lambda x, s: stack(x, s))(x, slots))
    np.testing.assert_allclose(got, _oracle(x, slots, a, b), rtol=1e-4, atol=1e-4)
    assert not got[slots == NO_LORA_SLOT].any()  # exactly zero, not merely small


@pytest.mark.cpu_only("the native CPU kernels")
@pytest.mark.skipif(cpu_kernels.kernel_error() is not None, reason=str(cpu_kernels.kernel_error()))
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
def test_bfloat16_slots_through_the_native_kernel_against_float64(rows):
    """x is rounded to bfloat16 as every bfloat16 projection rounds it, and so is the shrunk product."""
    attention = dataclasses.replace(AttentionConfig(), impl="cpu-native")
    assert attention.native_matmuls
    stack, a, b = _stack(ml_dtypes.bfloat16, attention)
    x = np.random.default_rng(1).normal(size=(rows, K)).astype(np.float32)
    slots = _slots(rows)
    got = np.asarray(jax.jit(lambda x, s: stack(x, s))(x, slots))
    rounded = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    want = _oracle(rounded, slots, a, b)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * scale)
    assert not got[slots == NO_LORA_SLOT].any()
