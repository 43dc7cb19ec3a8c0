"""The native matmuls' test shapes, operands and float64 oracle (tests/ops/test_cpu_kernels_matmul.py, also
imported by its subprocess)."""

import jax
import jax.numpy as jnp
import numpy as np

# Rows: 1-4 stream the weights in K-split units, 5-8 sweep blocks of them, 9-11 run register tiles on w in
# place, 12 and more tiles on packed panels (49 or more span two units). Columns: below, at and past the
# 32- and 64-column tiles, past the 512 at which panels widen to 64. K: odd (the last row pairs with zeros)
# and even, shorter and longer than a block of 32 rows, and split between threads (129, 257).
ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 11, 12, 13, 49, 64)
SHAPES = ((1, 1), (2, 31), (7, 33), (64, 64), (65, 100), (576, 192), (33, 577), (130, 1030), (129, 100),
          (257, 577))


def oracle(x: jax.Array, w: jax.Array, output_major_w: bool) -> np.ndarray:
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    return x64 @ (w64.T if output_major_w else w64)


def operands(m: int, k: int, n: int, output_major_w: bool, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k) if output_major_w else (k, n)), jnp.bfloat16)
    return x, w


def assert_close(got: np.ndarray, want: np.ndarray, k: int) -> None:
    # float32 sums of exact bfloat16 products: error grows with sqrt(K) terms of |x||w|.
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.sqrt(k) * 4)
