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


# Groups of rows (a mixture's assignments sorted by expert): empty groups, groups that stream (1-8 rows) and
# groups that tile (9 and more, 49 spanning two units), one group alone, and rows past the groups.
GROUPS = ((0, 3, 0, 1, 8), (5, 9, 13, 0, 49), (64,), (1,) * 12, (2, 0, 2))
GROUPED_SHAPES = ((7, 33), (64, 64), (130, 100), (257, 577))


def grouped_operands(groups: tuple[int, ...], k: int, n: int, spare_rows: int = 0,
                     seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """bf16 rows [sum + spare_rows, k], bf16 weights [groups, k, n] and the i32 group sizes."""
    rng = np.random.default_rng(seed)
    rows = jnp.asarray(rng.standard_normal((sum(groups) + spare_rows, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((len(groups), k, n)), jnp.bfloat16)
    return rows, w, jnp.asarray(groups, jnp.int32)


def grouped_oracle(rows: jax.Array, w: jax.Array, groups: tuple[int, ...]) -> np.ndarray:
    """Each group's rows times its weights in float64; rows past the groups zero."""
    rows64, w64 = np.asarray(rows, np.float64), np.asarray(w, np.float64)
    out = np.zeros((rows64.shape[0], w64.shape[2]))
    start = 0
    for g, size in enumerate(groups):
        out[start:start + size] = rows64[start:start + size] @ w64[g]
        start += size
    return out
