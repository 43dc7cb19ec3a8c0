"""Block-scaled FP8 weights stored K-major for Hopper's FP8 wgmma (`ops/fp8_block_matmul_mgpu.py`), which reads
both operands with their contracted axis contiguous and takes no transposed form: each such weight's values
[K, N] become [N, K] (`Fp8Weight.k_major`), as checkpoints store a linear layer. The runner lays out its state
before its steps take the state's form, and `jaxserve compile` lays out the abstract state the same way.
"""

import functools
import math
from typing import Any

import jax
from flax import nnx, traverse_util

from jaxserve.models.quantization import Fp8Weight
from jaxserve.ops import fp8_block_matmul, fp8_block_matmul_mgpu
from jaxserve.ops.attention import AttentionConfig


def kernel_layout(state: nnx.State, attention: AttentionConfig) -> int:
    """Stores, in place, each block-scaled FP8 weight K-major where Hopper's Mosaic GPU W8A8 kernel serves its
    large steps (`AttentionConfig.fp8_block_mosaic`) and its shape fits that kernel and the Triton block kernel,
    which serves its small ones from the same layout; returns how many. Arrays are transposed on their device
    one at a time, each row-major copy freed once its successor is made (the state must be the only holder of
    its weights: the runner lays them out before it takes them), so no more than one weight is held twice;
    ShapeDtypeStructs (deviceless compiles) take the new shape."""
    if attention.fp8_block_mosaic is None:
        return 0
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(state))
    laid_out = {}
    for path, value in flat.items():
        if fits(value):
            laid_out[path] = k_major(value)
            if isinstance(value.values, jax.Array):
                jax.block_until_ready(laid_out[path].values)
                value.values.delete()
    if laid_out:
        nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict({**flat, **laid_out}))
    return len(laid_out)


def fits(w: Any) -> bool:
    """Whether `w` is a row-major block-scaled FP8 weight both kernels take K-major."""
    if not isinstance(w, Fp8Weight) or w.k_major or not w.block:
        return False
    k = math.prod(w.shape[: w.contracted])
    n = math.prod(w.shape) // k
    return fp8_block_matmul_mgpu.fits(k, n, w.block) and fp8_block_matmul.fits(k, n, w.block)


def k_major(w: Fp8Weight) -> Fp8Weight:
    """`w` with its values stored [N, K] (`Fp8Weight.k_major`)."""
    k = math.prod(w.shape[: w.contracted])
    n = math.prod(w.shape) // k
    if isinstance(w.values, jax.ShapeDtypeStruct):
        values = jax.ShapeDtypeStruct((n, k), w.values.dtype, sharding=w.values.sharding)
    else:
        values = _transposed(w.values, k, n)
    return Fp8Weight(values, w.scale, w.contracted, w.block, k_major=True, dims=w.shape)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _transposed(values: jax.Array, k: int, n: int) -> jax.Array:  # [*contracted, *output] -> [N, K], stored so
    return values.reshape(k, n).T
