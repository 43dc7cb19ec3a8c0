"""Random weights in a model's real shapes (`--load-format dummy`, vLLM's flag and meaning).

For benchmarks on machines without the weights, and for short GPU runs: each parameter is drawn on its own
device(s), in its own dtype and sharding, by a jitted call, so an 8B model's 16 GB never pass through the
host. Matrices are uniform with transformers' `initializer_range` (0.02) as their standard deviation
(uniform bits are half the cost of normal ones), norm scales ones and biases zeros, so activations keep
their scale through the layers and the logits are not flat (greedy outputs vary).
"""

import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, traverse_util

logger = logging.getLogger(__name__)

INIT_STD = 0.02
_HALF_WIDTH = INIT_STD * 3**0.5  # uniform on [-w, w] has standard deviation w / sqrt(3)


def _kind(path: tuple) -> str:
    name = str(path[-1])
    return "ones" if name.endswith("scale") else "zeros" if name.endswith("bias") else "normal"


def dummy_weights(abstract: Any, seed: int = 0) -> dict[tuple, jax.Array]:
    """Every parameter of `abstract` (a `loader.AbstractModel`) drawn where it lives, by one jitted call
    (one compile, whatever the number of parameters); path -> array."""
    start = time.perf_counter()
    leaves = traverse_util.flatten_dict(nnx.to_pure_dict(abstract.state))
    specs = [(tuple(leaf.shape), jnp.dtype(leaf.dtype), _kind(path)) for path, leaf in leaves.items()]
    shardings = [abstract.sharding(path, leaf.shape) for path, leaf in leaves.items()]

    def draw(key: jax.Array) -> list[jax.Array]:
        values = []
        for index, (shape, dtype, kind) in enumerate(specs):
            if kind == "ones":
                values.append(jnp.ones(shape, dtype))
            elif kind == "zeros":
                values.append(jnp.zeros(shape, dtype))
            else:
                key_i = jax.random.fold_in(key, index)
                values.append(jax.random.uniform(key_i, shape, jnp.float32, -_HALF_WIDTH, _HALF_WIDTH).astype(dtype))
        return values

    out_shardings = None if abstract.mesh is None else shardings
    values = jax.jit(draw, out_shardings=out_shardings)(jax.random.key(seed, impl="rbg"))
    jax.block_until_ready(values)
    logger.info("weights: %d random tensors (--load-format dummy, %.2f GB) drawn in %.1fs", len(values),
                abstract.weights_bytes / 1e9, time.perf_counter() - start)
    return dict(zip(leaves, values, strict=True))
