"""The native GGUF matmul against a float64 oracle of the `gguf` package's own dequantization, for every block
format it reads (`cpu_kernels.matmul_gguf`)."""

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from jaxserve.ops import cpu_kernels

pytestmark = [
    pytest.mark.cpu_only("the native CPU kernels"),
    pytest.mark.skipif(cpu_kernels.kernel_error() is not None, reason=str(cpu_kernels.kernel_error())),
]

KINDS = tuple(cpu_kernels.GGUF_KINDS)
# Rows: one tile row, a partial tile, whole tiles, past a 64-row chunk. Columns: below and past a 4-row tile
# and a 16-row unit. K: one block, odd block counts, SmolLM2's widths.
ROWS = (1, 3, 4, 7, 64, 65)
SHAPES = ((32, 1), (32, 5), (96, 17), (576, 192), (1536, 33), (160, 64))


def _blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:  # u8[N, K / 32 * block_bytes]
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[:, :32] *= 40.0  # one block per row far from the others' scale
    if n > 2:
        w[1] = 0.0  # a zero row: scale 0
        w[2, :32] = 1e-6  # scales among float16's subnormals
    return quantize(w, GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", ROWS)
def test_matmul_against_float64(kind, m):
    call = jax.jit(lambda x, w: cpu_kernels.matmul_gguf(x, w, kind))
    rng = np.random.default_rng(m)
    for k, n in SHAPES:
        blocks = _blocks(kind, n, k)
        weights = dequantize(blocks, GGMLQuantizationType[kind]).astype(np.float64)  # [N, K]
        x = rng.standard_normal((m, k)).astype(np.float32)
        want = x.astype(np.float64) @ weights.T
        got = np.asarray(call(x, blocks))
        scale = np.abs(x).astype(np.float64) @ np.abs(weights).T  # float32 sums: error relative to sum |x||w|
        assert got.shape == (m, n)
        assert np.all(np.abs(got - want) <= 1e-6 * scale + 1e-30), (kind, m, k, n)


def test_matmul_refuses_mismatched_blocks():
    blocks = _blocks("Q4_1", 4, 64)
    with pytest.raises(Exception, match="mismatched shapes"):
        cpu_kernels.matmul_gguf(np.ones((2, 96), np.float32), blocks, "Q4_1")
    with pytest.raises(ValueError, match="u8 blocks"):
        cpu_kernels.matmul_gguf(np.ones((2, 64), np.float32), blocks.astype(np.int32), "Q4_1")


def test_empty_rows():
    assert cpu_kernels.matmul_gguf(np.ones((0, 64), np.float32), _blocks("Q8_0", 3, 64), "Q8_0").shape == (0, 3)
