"""A mixture's grouped matmul: rows sorted by expert times their own expert's weights, 16-bit or FP8 e4m3
(`models/quantization.Fp8Experts`), as a Triton-backed Pallas kernel for CUDA GPUs (sm_80 and later; e4m3
experts: sm_89 and later, whose Triton converts e4m3 in hardware), and in interpret mode on CPUs for tests.

Why: XLA's ragged dot on a GPU multiplies every row by every expert through a dense f32[E, rows, N]
temporary, which grows with the rows; over FP8 experts with block scales it first writes the widened experts
out. The roofline reads each expert that has rows once, and nothing else of the size of the experts.

Layout (vLLM's fused MoE kernel aligns its rows the same way): each expert's sorted rows are cut into tiles
of `block_t` rows, its last tile partial, so that every tile holds one expert's rows (`_TileLayout`: each
tile's expert, first row and row count). A program loads its tile's rows straight from the sorted rows,
masked past its count, and stores its products the same way: nothing is gathered into a padded copy. The
tile count is a static bound (whole tiles of all rows, plus a partial tile for each expert that can have rows,
and no more tiles than rows); tiles past the ones in use do nothing.

Work split. The grid is (row tile, output tile), row tile fastest, so that an expert's row tiles run side by
side and share its weight tile through L2. A program reads its tile's expert, then walks the contracted axis
`block_k` rows at a time: it loads the rows' [block_t, block_k] activations and the expert's [block_k,
block_n] values, widens e4m3 values to the activations' dtype in registers and multiplies in float32. Block
scales (`block_k` is then the scale block) scale each step's product; a scale per channel scales the sum.
Each expert weight is read once per output tile from memory, and only for the experts that have rows.

Rows in e4m3 too (W8A8: `row_scale`, a scale per row, or per row and scale block for block-scaled experts)
meet the values as they are, e4m3 x e4m3, on FP8 tensor cores where Triton runs that dot on them
(`fp8_block_matmul.FP8_MMA_COMPUTE_CAPABILITIES`); each product is then scaled by its rows' scales too.
"""

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxserve.ops.fp8_block_matmul import MIN_FP8_DOT_K
from jaxserve.ops.paged_attention_pallas import next_pow2

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # a jax that has dropped the backend
    plgpu = None

_MIN_DOT_DIM = 16  # Triton's dot needs every dimension >= 16
_MAX_BLOCK_T = 64
_WIDTHS = (128, 64, 32, 16)  # output and contracted tiles, the widest first

SIXTEEN_BIT = (jnp.bfloat16, jnp.float16)  # the experts' dtypes it multiplies as they are (else e4m3, scaled)
MIN_COMPUTE_CAPABILITY = 8.0  # bfloat16 dots (Ampere); e4m3 experts: fp8_block_matmul.MIN_COMPUTE_CAPABILITY
# Shared memory a program's pipelined loads may take (`num_stages` x a step's rows and weight tile): under the
# 99 KiB a block may have on sm_89 (Ada), with room for Triton's own.
SHARED_MEMORY_BUDGET = 72 * 1024
NUM_STAGES = 3


def contracted_tile(k: int, block: int) -> int | None:
    """The contracted rows a step of the kernel walks: a block scale's block (a power of two of at least 16
    that divides K), or for one scale per channel (`block` >= K) or none (`block` 0) the widest tile that
    divides K; None where neither exists."""
    if 0 < block < k:  # a scale block: a power of two Triton's dot takes, at most the widest tile (shared memory)
        fits_dot = _MIN_DOT_DIM <= block <= _WIDTHS[0] and block == next_pow2(block)
        return block if fits_dot and k % block == 0 else None
    return next((width for width in _WIDTHS if k % width == 0), None)


def tiles(num_rows: int, num_groups: int, k: int, n: int, block: int, row_bytes: int,
          value_bytes: int) -> tuple[int, int, int]:
    """(block_t, block_n, block_k): row tiles of the rows an expert has on average (16 to 64), the widest output
    and contracted tiles that divide N and K (a scale block's K tile fixed), narrowed (outputs first, then the
    contracted rows, then the row tile) until `NUM_STAGES` steps' loads fit `SHARED_MEMORY_BUDGET`."""
    block_t = min(_MAX_BLOCK_T, max(_MIN_DOT_DIM, next_pow2(pl.cdiv(num_rows, num_groups))))
    block_k = contracted_tile(k, block)
    block_n = next(width for width in _WIDTHS if n % width == 0)

    def shared(t: int, n_: int, k_: int) -> int:
        return NUM_STAGES * (t * k_ * row_bytes + k_ * n_ * value_bytes)

    while shared(block_t, block_n, block_k) > SHARED_MEMORY_BUDGET:
        if block_n > 32:
            block_n //= 2
        elif not 0 < block < k and block_k > 32:  # a scale block's contracted tile is the block
            block_k //= 2
        elif block_t > _MIN_DOT_DIM:
            block_t //= 2
        else:
            break
    return block_t, block_n, block_k


def fits(k: int, n: int, block: int = 0, fp8_rows: bool = False) -> bool:
    """Whether experts [G, K, N] (with scales per `block` contracted rows, 0 for 16-bit experts) are the kernel's:
    a contracted tile (`contracted_tile`; with rows in e4m3, `fp8_rows`, at least
    `fp8_block_matmul.MIN_FP8_DOT_K`), outputs a tile divides."""
    tile = contracted_tile(k, block)
    return tile is not None and n % _WIDTHS[-1] == 0 and (not fp8_rows or tile >= MIN_FP8_DOT_K)


@dataclass(frozen=True)
class _TileLayout:
    """Each row tile's expert, first sorted row and row count: an expert's rows cut into tiles of `block_t`
    in order, the tiles past the ones in use with no rows (and expert G). Arrays are traced: one layout a
    step."""

    group: jax.Array  # i32[tiles]
    first_row: jax.Array  # i32[tiles]
    num_rows: jax.Array  # i32[tiles]: 1 to block_t, 0 past the tiles in use

    @classmethod
    def of(cls, group_sizes: jax.Array, num_rows: int, block_t: int) -> "_TileLayout":
        num_groups = group_sizes.shape[0]
        # whole tiles of all rows and a partial one an expert with rows; and never more tiles than rows
        num_tiles = min(num_rows, num_rows // block_t + min(num_groups, num_rows))
        tiles = (group_sizes + block_t - 1) // block_t  # i32[G]: each expert's row tiles
        tile_ends = jnp.cumsum(tiles)
        rows_before = jnp.cumsum(group_sizes) - group_sizes  # i32[G]: each expert's first sorted row
        tile = jnp.arange(num_tiles)
        group = jnp.searchsorted(tile_ends, tile, side="right", method="compare_all")  # i32[tiles]; G past them
        clipped = jnp.minimum(group, num_groups - 1)
        first_in_group = (tile - (tile_ends - tiles)[clipped]) * block_t
        rows = jnp.clip(group_sizes[clipped] - first_in_group, 0, block_t)
        return cls(group, rows_before[clipped] + first_in_group, jnp.where(group < num_groups, rows, 0))


def _kernel(group_ref, first_row_ref, num_rows_ref, x_ref, values_ref, *refs, block_t: int, block_n: int,
            block_k: int, steps: int, scales: str, fp8_rows: bool) -> None:
    """One program: its row tile times its expert's output tile [block_n], over the contracted axis in `steps`
    steps of `block_k` rows (module docstring); a tile with no rows does nothing. `scales`: "none" (16-bit
    experts: refs are the output), "block" or "channel" (refs are the scales, with `fp8_rows` the rows' scales,
    and the output)."""
    scale_ref, row_scale_ref, out_ref = ((None, None, *refs) if scales == "none" else
                                         (*refs,) if fp8_rows else (refs[0], None, refs[1]))
    tile, n_tile = pl.program_id(0), pl.program_id(1)
    group, count = group_ref[tile], num_rows_ref[tile]
    in_tile = jnp.arange(block_t, dtype=jnp.int32)
    row_ok = (in_tile < count)[:, None]  # [block_t, 1]
    # The tile's sorted rows, [block_t, 1]; its masked ones run past them, into the output's block_t spare rows
    # (distinct rows: the interpreter writes a masked row back as it was, which a repeated row would undo).
    rows = (first_row_ref[tile] + in_tile)[:, None]
    loaded_rows = jnp.minimum(rows, x_ref.shape[0] - 1)
    columns = pl.ds(pl.multiple_of(n_tile * block_n, block_n), block_n)

    def row_scales(column: jax.Array | int) -> jax.Array:  # f32[block_t, 1]: the rows' scales in that column
        return plgpu.load(row_scale_ref.at[loaded_rows, jnp.full((1, 1), column, jnp.int32)], mask=row_ok,
                          other=0.0)

    @pl.when(count > 0)
    def _multiply() -> None:
        def body(step, acc):  # acc: f32[block_t, block_n]
            first = pl.multiple_of(step * block_k, block_k)
            x = plgpu.load(x_ref.at[loaded_rows, first + jnp.arange(block_k)[None, :]],
                           mask=row_ok, other=0.0)  # [block_t, block_k]: the tile's rows, zeros past them
            w = values_ref[group, pl.ds(first, block_k), columns]
            if not fp8_rows:
                w = w.astype(x.dtype)  # e4m3 widened in registers
            product = jnp.dot(x, w, preferred_element_type=jnp.float32)
            if scales == "block":
                product = product * scale_ref[group, pl.ds(step, 1), columns]  # * f32[1, block_n]
                if fp8_rows:
                    product = product * row_scales(step)
            return acc + product

        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((block_t, block_n), jnp.float32))
        if scales == "channel":
            acc = acc * scale_ref[group, pl.ds(0, 1), columns]
            if fp8_rows:
                acc = acc * row_scales(0)
        output_columns = n_tile * block_n + jnp.arange(block_n, dtype=jnp.int32)[None, :]
        plgpu.store(out_ref.at[rows, output_columns], acc, mask=row_ok)


def grouped_matmul(
    rows: jax.Array,  # [A, K] sorted by group, in float32, float16 or bfloat16 (16-bit experts: their dtype)
    values: jax.Array,  # [G, K, N]: bfloat16 or float16, or f8e4m3fn with `scale`
    group_sizes: jax.Array,  # i32[G]: rows of each group, in order; rows past their sum come back as zeros
    scale: jax.Array | None = None,  # e4m3 values': f32[G, K / block, N], or f32[G, 1, N] (a scale per channel)
    block: int = 0,  # contracted rows a scale covers (K or more for a scale per channel)
    row_scale: jax.Array | None = None,  # e4m3 rows': f32[A, K / block], or f32[A, 1] with a scale per channel
    *,
    interpret: bool = False,
    num_warps: int = 4,
) -> jax.Array:  # f32[A, N]
    """rows[group g] @ values[g] (scaled by scale[g]) for every group, float32 sums (module docstring)."""
    if plgpu is None:  # its masked loads and stores are the backend's, interpreted too
        raise RuntimeError("this jax has no Pallas Triton backend")
    num_rows, k = rows.shape
    num_groups, _, n = values.shape
    block_k = contracted_tile(k, block if scale is not None else 0)
    scales = "none" if scale is None else "channel" if scale.shape[1] == 1 else "block"
    fp8_rows = row_scale is not None
    if (not fits(k, n, block if scale is not None else 0, fp8_rows) or values.shape[1] != k
            or group_sizes.shape != (num_groups,)
            or (scale is None) != (values.dtype in SIXTEEN_BIT)
            or (scale is not None and scale.shape != (num_groups, 1 if scales == "channel" else k // block, n))
            or fp8_rows != (rows.dtype == values.dtype == jnp.float8_e4m3fn)
            or (fp8_rows and row_scale.shape != (num_rows, scale.shape[1]))):
        raise ValueError(f"grouped_matmul: rows {rows.shape} {rows.dtype}, values {values.shape} {values.dtype}, scale "
                         f"{None if scale is None else scale.shape}, row_scale "
                         f"{None if row_scale is None else row_scale.shape}, block {block}, "
                         f"group_sizes {group_sizes.shape}")
    block_t, block_n, block_k = tiles(num_rows, num_groups, k, n, block if scale is not None else 0,
                                      rows.dtype.itemsize, values.dtype.itemsize)
    layout = _TileLayout.of(group_sizes, num_rows, block_t)
    kernel = functools.partial(_kernel, block_t=block_t, block_n=block_n, block_k=block_k, steps=k // block_k,
                               scales=scales, fp8_rows=fp8_rows)
    operands = ((layout.group, layout.first_row, layout.num_rows, rows, values)
                + (() if scale is None else (scale,)) + ((row_scale,) if fp8_rows else ()))
    whole = pl.BlockSpec()  # the kernel indexes these itself
    out = pl.pallas_call(
        kernel,
        grid=(layout.group.shape[0], n // block_n),  # the first axis varies fastest in launch order
        in_specs=[whole] * len(operands),
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((num_rows + block_t, n), jnp.float32),  # block_t spare rows (`_kernel`)
        compiler_params=None if plgpu is None else plgpu.CompilerParams(num_warps=num_warps, num_stages=NUM_STAGES),
        interpret=interpret,
        name="grouped_matmul",
    )(*operands)  # f32[A + block_t, N]: no tile writes the rows past the groups, nor the spare rows
    return jnp.where((jnp.arange(num_rows) < group_sizes.sum())[:, None], out[:num_rows], 0.0)
