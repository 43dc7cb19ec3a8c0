"""x @ w for FP8 weights with block scales (an FP8 checkpoint's `weight_block_size`, `models/quantization.py`)
as a Triton-backed Pallas kernel for CUDA GPUs that convert e4m3 in hardware (sm_89 and later), and in
interpret mode on CPUs for tests.

XLA does not fuse a block scale into its GEMM: it writes the widened, scaled weight (2 bytes a weight) and
the GEMM reads it back, five bytes of traffic a weight where a 16-bit weight costs two (a deviceless H100
compile: docs/benchmarks.md). Here each program widens its tiles of e4m3 values in registers and scales its
partial products by the block's scales, so the weight is read once, one byte a weight, with its scales (4
bytes per output channel and block of contracted rows: 1/32 of a byte a weight at blocks of 128).

Work split. The grid is (row tile, output tile, split of the contracted axis). A program walks its share of
the contracted axis one scale block (`block` rows, 128 in released checkpoints) at a time: it loads the
rows' [block_t, block] activations and the [block, block_n] values, widens the values to the activations'
dtype, multiplies in float32 and adds the product times the block's scales [block_n] to its accumulator.
When rows x output tiles are too few to keep every multiprocessor streaming weights (a decode step's few
rows), the contracted axis is split over programs, which write float32 partial sums that XLA adds up.
The row tile (the first grid axis) varies fastest, so the programs that read the same weight tile run
side by side and share it through L2: the weight streams from memory once, and the activations (a few MB
at most) are what is read again, from L2.

The rows of a prefill (many tokens) are compute-bound: there XLA's own GEMM over the widened weight serves
better than Triton's dot, and `fits` says which rows go where.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxserve.ops.paged_attention_pallas import next_pow2

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # a jax that has dropped the backend
    plgpu = None

TRITON_BACKEND = plgpu is not None  # compiled, the kernel needs it (interpreted, not)

# The most rows the kernel serves: past them a step is the tensor cores' rather than the memory's, and there
# XLA's GEMM over the widened weight (wgmma on Hopper) outruns Triton's dot.
KERNEL_MAX_ROWS = 256
_MIN_DOT_DIM = 16  # Triton's dot needs every dimension >= 16
_MAX_BLOCK_T = 64
_BLOCK_N = (128, 64, 32, 16)  # output tiles, the widest first
_WAVES = 2  # aim for this many programs per multiprocessor
# Splits of the contracted axis write float32 partial sums [splits, rows, N]: at most this fraction of the
# weight's own bytes.
_MAX_PARTIAL_SHARE = 1 / 8
_DEFAULT_NUM_SMS = 132  # an H100 SXM


# The oldest CUDA GPUs whose Triton converts e4m3 in hardware (Ada, sm_89).
MIN_COMPUTE_CAPABILITY = 8.9


def fits(rows: int, k: int, n: int, block: int) -> bool:
    """Whether a [rows, k] x [k, n] product with scales per `block` contracted rows is the kernel's: at most
    KERNEL_MAX_ROWS rows, a block that is a power of two Triton's dot takes and divides k, and outputs a tile
    divides."""
    return rows <= KERNEL_MAX_ROWS and _shapes_fit(k, n, block)


def _shapes_fit(k: int, n: int, block: int) -> bool:
    """A block Triton's dot takes (a power of two, at least 16) that divides k; outputs the narrowest tile divides."""
    return block >= _MIN_DOT_DIM and block == next_pow2(block) and k % block == 0 and n % _BLOCK_N[-1] == 0


def _kernel(x_ref, values_ref, scale_ref, out_ref, *, block: int, block_t: int, block_n: int,
            blocks_per_split: int) -> None:
    """One program: rows [block_t] of its row tile times outputs [block_n] of its output tile, over its split's
    `blocks_per_split` scale blocks of the contracted axis; writes its sum to `out_ref[split]` (module docstring)."""
    t_tile, n_tile, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(pl.multiple_of(t_tile * block_t, block_t), block_t)
    columns = pl.ds(pl.multiple_of(n_tile * block_n, block_n), block_n)
    first = split * blocks_per_split

    def body(j, acc):  # acc: f32[block_t, block_n]
        kb = first + j
        contracted = pl.ds(pl.multiple_of(kb * block, block), block)
        x = x_ref[rows, contracted]  # [block_t, block]
        w = values_ref[contracted, columns].astype(x.dtype)  # e4m3 -> x's dtype in registers: [block, block_n]
        scale = scale_ref[pl.ds(kb, 1), columns]  # f32[1, block_n]
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32) * scale

    acc = jax.lax.fori_loop(0, blocks_per_split, body, jnp.zeros((block_t, block_n), jnp.float32))
    out_ref[split, rows, columns] = acc.astype(out_ref.dtype)


def fp8_block_matmul(
    x: jax.Array,  # [T, K] in float32, float16 or bfloat16
    values: jax.Array,  # f8e4m3fn[K, N]
    scale: jax.Array,  # f32[K / block, N]: row k of `values` is scaled by scale[k // block]
    block: int,
    *,
    num_sms: int = _DEFAULT_NUM_SMS,
    interpret: bool = False,
    num_warps: int = 4,
    num_stages: int = 3,
) -> jax.Array:  # [T, N] in x's dtype
    """x @ (values scaled by their blocks' scales), float32 sums, in x's dtype (module docstring)."""
    if plgpu is None and not interpret:
        raise RuntimeError("this jax has no Pallas Triton backend")
    rows, k = x.shape
    n = values.shape[1]
    if not _shapes_fit(k, n, block) or values.shape[0] != k or scale.shape != (k // block, n):
        raise ValueError(f"fp8_block_matmul: x {x.shape}, values {values.shape}, scale {scale.shape}, block {block}")
    block_t, block_n, splits = tiles(rows, k, n, block, num_sms)
    row_tiles, blocks = pl.cdiv(rows, block_t), k // block
    padded = jnp.pad(x, ((0, row_tiles * block_t - rows), (0, 0)))
    kernel = functools.partial(_kernel, block=block, block_t=block_t, block_n=block_n,
                               blocks_per_split=blocks // splits)
    whole = pl.BlockSpec()  # the kernel indexes these itself
    sums = pl.pallas_call(
        kernel,
        grid=(row_tiles, n // block_n, splits),  # the first axis varies fastest in launch order
        in_specs=[whole, whole, whole],
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((splits, row_tiles * block_t, n), jnp.float32 if splits > 1 else x.dtype),
        compiler_params=None if plgpu is None else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="fp8_block_matmul",
    )(padded, values, scale)  # [splits, T_padded, N]: float32 partial sums, or with one split the product
    return (sums[0] if splits == 1 else sums.sum(axis=0))[:rows].astype(x.dtype)


def tiles(rows: int, k: int, n: int, block: int, num_sms: int = _DEFAULT_NUM_SMS) -> tuple[int, int, int]:
    """(block_t, block_n, splits): row tiles of up to `_MAX_BLOCK_T`; the widest output tile that gives every
    multiprocessor `_WAVES` programs; where none does, the narrowest of at least 32 outputs and the fewest
    splits of the contracted axis (a divisor of its blocks, so every split walks as many) that do, as far
    as their partial sums stay within `_MAX_PARTIAL_SHARE` of the weight's bytes."""
    block_t = min(_MAX_BLOCK_T, max(_MIN_DOT_DIM, next_pow2(rows)))
    row_tiles, blocks = pl.cdiv(rows, block_t), k // block
    widths = [b for b in _BLOCK_N if n % b == 0]
    wanted = _WAVES * num_sms
    if (block_n := next((b for b in widths if n // b * row_tiles >= wanted), None)) is not None:
        return block_t, block_n, 1
    block_n = min((b for b in widths if b >= 32), default=widths[-1])
    most = max(1, int(_MAX_PARTIAL_SHARE * k / (4 * row_tiles * block_t)))  # partial bytes <= share x K x N
    fewest = pl.cdiv(wanted, n // block_n * row_tiles)
    divisors = [s for s in range(1, min(blocks, most) + 1) if blocks % s == 0]
    return block_t, block_n, next((s for s in divisors if s >= fewest), divisors[-1])
