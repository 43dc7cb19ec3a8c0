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
dtype (e4m3 rows meet them as they are), multiplies in float32 and adds the product times the block's
scales [block_n] to its accumulator.
When rows x output tiles are too few to keep every multiprocessor streaming weights (a decode step's few
rows), the contracted axis is split over programs, which write float32 partial sums that XLA adds up.
The row tile (the first grid axis) varies fastest, so the programs that read the same weight tile run
side by side and share it through L2: the weight streams from memory once, and the activations are what
is read again, mostly from L2.

Rows of any count are the kernel's. The rows of a prefill (many tokens) are compute-bound, and there
XLA's GEMM over the widened weight might have been the faster one; but XLA widens the weights of a whole
step's layers ahead of their GEMMs (Llama-3-8B's 2,048-token step compiled for an H100 keeps 8.3 GiB of
them at once, KV cache the server no longer has), and on Hopper Triton runs the kernel's 16-bit dot on
bfloat16 wgmma (docs/benchmarks.md, stop 112).

Rows in e4m3 too (W8A8, with a scale per row and block of contracted columns: `x_scale`, DeepSeek-V3's
1 x 128 activation groups, vLLM's `per_token_group_quant_fp8`) XLA cannot take at all: each block's product
is scaled by its rows' own scales before the blocks are summed, which XLA's GEMM would write out as a
[blocks, rows, N] float32 temporary. Here each block's e4m3 x e4m3 dot is summed in float32 (on Ada's FP8
tensor cores; see FP8_MMA_COMPUTE_CAPABILITIES for Hopper), and its two scales multiply the partial product
in registers.
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
# The CUDA GPUs where an e4m3 x e4m3 dot, as Pallas hands it to Triton, runs on FP8 tensor cores: Ada's
# `mma.sync ... e4m3.e4m3` (sm_89). On Hopper it compiles to float16 `mma.sync` over widened operands:
# Pallas sets no `max_num_imprecise_acc`, and Triton declines wgmma for FP8 operands summed in float32
# without it (deviceless compiles: docs/benchmarks.md). That runs below the kernel's 16-bit rows on bfloat16
# wgmma, so Hopper keeps those.
FP8_MMA_COMPUTE_CAPABILITIES = (8.9,)
# The narrowest contracted tile an e4m3 x e4m3 dot takes: Triton's frontend asks 32 of 8-bit operands (Ada's
# e4m3 MMA is k32), a check Pallas does not make.
MIN_FP8_DOT_K = 32


def fits(k: int, n: int, block: int, fp8_rows: bool = False) -> bool:
    """Whether a [rows, k] x [k, n] product with scales per `block` contracted rows is the kernel's: a block
    Triton's dot takes (a power of two, at least 16, at least MIN_FP8_DOT_K with rows in e4m3: `fp8_rows`) that
    divides k, and outputs the narrowest tile divides."""
    narrowest = MIN_FP8_DOT_K if fp8_rows else _MIN_DOT_DIM
    return block >= narrowest and block == next_pow2(block) and k % block == 0 and n % _BLOCK_N[-1] == 0


def _kernel(x_ref, values_ref, scale_ref, *refs, block: int, block_t: int, block_n: int,
            blocks_per_split: int, k_major: bool) -> None:
    """One program: rows [block_t] of its row tile times outputs [block_n] of its output tile, over its split's
    `blocks_per_split` scale blocks of the contracted axis; writes its sum to `out_ref[split]` (module docstring).
    `refs` is (out_ref,) for 16-bit rows, (x_scale_ref, out_ref) for rows in e4m3."""
    *x_scale_ref, out_ref = refs
    t_tile, n_tile, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(pl.multiple_of(t_tile * block_t, block_t), block_t)
    columns = pl.ds(pl.multiple_of(n_tile * block_n, block_n), block_n)
    first = split * blocks_per_split

    def body(j, acc):  # acc: f32[block_t, block_n]
        kb = first + j
        contracted = pl.ds(pl.multiple_of(kb * block, block), block)
        x = x_ref[rows, contracted]  # [block_t, block]: 16-bit, or e4m3 with a scale per row
        # e4m3 [block, block_n]; stored [N, K], read as [block_n, block] and transposed
        w = values_ref[columns, contracted].T if k_major else values_ref[contracted, columns]
        scale = scale_ref[pl.ds(kb, 1), columns]  # f32[1, block_n]
        if x_scale_ref:  # e4m3 x e4m3 (FP8 tensor cores on Ada), then both operands' scales
            scale = x_scale_ref[0][rows, pl.ds(kb, 1)] * scale  # f32[block_t, 1] x [1, block_n]
        else:
            w = w.astype(x.dtype)  # e4m3 -> x's dtype in registers
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32) * scale

    acc = jax.lax.fori_loop(0, blocks_per_split, body, jnp.zeros((block_t, block_n), jnp.float32))
    out_ref[split, rows, columns] = acc.astype(out_ref.dtype)


def fp8_block_matmul(
    x: jax.Array,  # [T, K] in float32, float16 or bfloat16; or e4m3 with `x_scale`
    values: jax.Array,  # f8e4m3fn[K, N], or [N, K] with `k_major`
    scale: jax.Array,  # f32[K / block, N]: row k of `values` is scaled by scale[k // block]
    block: int,
    *,
    x_scale: jax.Array | None = None,  # f32[T, K / block]: column k of e4m3 row t is scaled by x_scale[t, k // block]
    out_dtype: jnp.dtype | None = None,  # the result's dtype: x's unless given (required with e4m3 rows)
    k_major: bool = False,  # values stored [N, K] (`fp8_layout.kernel_layout`: Hopper's FP8 wgmma reads them so)
    num_sms: int = _DEFAULT_NUM_SMS,
    interpret: bool = False,
    num_warps: int = 4,
    num_stages: int = 3,
) -> jax.Array:  # [T, N] in out_dtype
    """(x scaled by its blocks' scales) @ (values scaled by their blocks' scales), float32 sums (module docstring)."""
    if plgpu is None and not interpret:
        raise RuntimeError("this jax has no Pallas Triton backend")
    rows, k = x.shape
    n = values.shape[0 if k_major else 1]
    fp8_rows = x_scale is not None
    if fp8_rows and out_dtype is None:
        raise ValueError("fp8_block_matmul: rows in e4m3 need an out_dtype")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    stored = (n, k) if k_major else (k, n)
    if (not fits(k, n, block, fp8_rows) or values.shape != stored or scale.shape != (k // block, n)
            or fp8_rows != (x.dtype == values.dtype) or (fp8_rows and x_scale.shape != (rows, k // block))):
        raise ValueError(f"fp8_block_matmul: x {x.shape} {x.dtype}, values {values.shape}, scale {scale.shape}, "
                         f"x_scale {None if x_scale is None else x_scale.shape}, block {block}")
    block_t, block_n, splits = tiles(rows, k, n, block, num_sms)
    row_tiles, blocks = pl.cdiv(rows, block_t), k // block
    pad = ((0, row_tiles * block_t - rows), (0, 0))
    operands = (jnp.pad(x, pad), values, scale) + ((jnp.pad(x_scale, pad),) if fp8_rows else ())
    kernel = functools.partial(_kernel, block=block, block_t=block_t, block_n=block_n,
                               blocks_per_split=blocks // splits, k_major=k_major)
    whole = pl.BlockSpec()  # the kernel indexes these itself
    sums = pl.pallas_call(
        kernel,
        grid=(row_tiles, n // block_n, splits),  # the first axis varies fastest in launch order
        in_specs=[whole] * len(operands),
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((splits, row_tiles * block_t, n), jnp.float32 if splits > 1 else out_dtype),
        compiler_params=None if plgpu is None else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="fp8_block_matmul",
    )(*operands)  # [splits, T_padded, N]: float32 partial sums, or with one split the product
    return (sums[0] if splits == 1 else sums.sum(axis=0))[:rows].astype(out_dtype)


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
