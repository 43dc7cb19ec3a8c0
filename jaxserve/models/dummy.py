"""Random weights in a model's real shapes (`--load-format dummy`, vLLM's flag and meaning).

For benchmarks on machines without the weights, and for short GPU runs: each parameter is drawn on its own
device(s), in its own dtype and sharding, by a jitted call, so an 8B model's 16 GB never pass through the
host. Matrices are uniform with transformers' `initializer_range` (0.02) as their standard deviation
(uniform bits are half the cost of normal ones), norm scales ones and biases zeros, so activations keep
their scale through the layers and the logits are not flat (greedy outputs vary).
"""

import functools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

logger = logging.getLogger(__name__)

INIT_STD = 0.02
_HALF_WIDTH = INIT_STD * 3**0.5  # uniform on [-w, w] has standard deviation w / sqrt(3)


def _kind(path: tuple) -> str:
    name = str(path[-1])
    return "ones" if name.endswith("scale") else "zeros" if name.endswith("bias") else "normal"


def _draw(key: jax.Array, index: jax.Array, *, shape: tuple[int, ...], dtype: jnp.dtype, kind: str) -> jax.Array:
    if kind == "ones":
        return jnp.ones(shape, dtype)
    if kind == "zeros":
        return jnp.zeros(shape, dtype)
    key = jax.random.fold_in(key, index)
    return jax.random.uniform(key, shape, jnp.float32, -_HALF_WIDTH, _HALF_WIDTH).astype(dtype)


def dummy_weights(abstract: Any, seed: int = 0) -> dict[tuple, jax.Array]:
    """Every parameter of `abstract` (a `loader.AbstractModel`) drawn where it lives; path -> array.

    One compiled draw per distinct (shape, dtype, kind, sharding), called once per parameter with its own
    index: a model's layers repeat a handful of shapes, and on a GPU each compile costs ~0.1 s per kernel
    (one jitted call drawing all of GPT-2's 148 tensors took 19 s to compile on an H100). The distinct
    draws compile at once on threads (XLA releases the GIL while it compiles)."""
    start = time.perf_counter()
    leaves = traverse_util.flatten_dict(nnx.to_pure_dict(abstract.state))
    key = jax.random.key(seed, impl="rbg")
    signatures = [(tuple(leaf.shape), jnp.dtype(leaf.dtype), _kind(path),
                   None if abstract.mesh is None else abstract.sharding(path, leaf.shape))
                  for path, leaf in leaves.items()]

    def compile_draw(signature: tuple) -> Any:
        shape, dtype, kind, sharding = signature
        draw = jax.jit(functools.partial(_draw, shape=shape, dtype=dtype, kind=kind), out_shardings=sharding)
        return draw.lower(key, np.int32(0)).compile()

    distinct = list(dict.fromkeys(signatures))
    with ThreadPoolExecutor(max_workers=max(1, min(len(distinct), os.cpu_count() or 1)),
                            thread_name_prefix="jaxserve-dummy") as pool:
        draws = dict(zip(distinct, pool.map(compile_draw, distinct), strict=True))
    values = [draws[signature](key, np.int32(index)) for index, signature in enumerate(signatures)]
    jax.block_until_ready(values)
    logger.info("weights: %d random tensors (--load-format dummy, %.2f GB, %d distinct draws) drawn in %.1fs",
                len(values), abstract.weights_bytes / 1e9, len(draws), time.perf_counter() - start)
    return dict(zip(leaves, values, strict=True))
