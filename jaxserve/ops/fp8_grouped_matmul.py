"""A mixture's grouped matmul over FP8 experts (`models/quantization.Fp8Experts`): rows sorted by expert times
their own expert's e4m3 weights, as a Triton-backed Pallas kernel for CUDA GPUs that convert e4m3 in hardware
(sm_89 and later), and in interpret mode on CPUs for tests.

Why: XLA's ragged dot on a GPU multiplies every row by every expert through a dense temporary, and over FP8
experts it first writes the widened experts out. A decode step then moves about five bytes per weight of all
E experts (one read in e4m3, two written and two read back in 16 bits), where the roofline reads one byte per
weight of the experts its tokens touch.

Layout (vLLM's fused MoE kernel aligns its rows the same way): each expert's rows are padded to whole row
tiles of `block_t`, so that every tile holds one expert's rows. XLA gathers the sorted rows into that padded
layout [tiles * block_t, K], zeros in the padding (`_TileLayout`), the kernel multiplies tile by tile, and XLA
gathers the products back into the sorted order. The tile count is a static bound (whole tiles of all rows,
plus a partial tile for each expert that can have rows, and no more tiles than rows); tiles past the ones in
use do nothing.

Work split. The grid is (row tile, output tile), row tile fastest, so that an expert's row tiles run side by
side and share its weight tile through L2. A program reads its tile's expert, then walks the contracted axis
`block_k` rows at a time: it loads the rows' [block_t, block_k] activations and the expert's [block_k,
block_n] values, widens the values to the activations' dtype in registers and multiplies in float32. Block
scales (`block_k` is then the scale block) scale each step's product; a scale per channel scales the sum.
Each expert weight is read once per output tile from memory, one byte a weight, and only for the experts
that have rows.
"""

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxserve.ops.paged_attention_pallas import next_pow2

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # a jax that has dropped the backend
    plgpu = None

_MIN_DOT_DIM = 16  # Triton's dot needs every dimension >= 16
_MAX_BLOCK_T = 64
_WIDTHS = (128, 64, 32, 16)  # output and contracted tiles, the widest first

# The most sorted rows (tokens x experts a token) the kernel takes. Past them a step's experts each have many
# rows and the step is the tensor cores': there the 16-bit paths (Hopper's Mosaic GPU grouped matmul) serve.
KERNEL_MAX_ROWS = 2048


def contracted_tile(k: int, block: int) -> int | None:
    """The contracted rows a step of the kernel walks: a block scale's block (a power of two of at least 16
    that divides K), or for one scale per channel (`block` >= K) the widest tile that divides K; None where
    neither exists."""
    if block < k:
        return block if block >= _MIN_DOT_DIM and block == next_pow2(block) and k % block == 0 else None
    return next((width for width in _WIDTHS if k % width == 0), None)


def fits(rows: int, k: int, n: int, block: int) -> bool:
    """Whether [rows, K] sorted rows times experts [G, K, N] with scales per `block` contracted rows are the
    kernel's: at most KERNEL_MAX_ROWS rows, a contracted tile (`contracted_tile`), outputs a tile divides."""
    return rows <= KERNEL_MAX_ROWS and contracted_tile(k, block) is not None and n % _WIDTHS[-1] == 0


@dataclass(frozen=True)
class _TileLayout:
    """Where each sorted row goes in the padded layout, and each tile's expert (`num_groups` past the tiles in
    use). Arrays are traced: one layout a step."""

    tile_group: jax.Array  # i32[tiles]
    source_row: jax.Array  # i32[tiles * block_t]: the sorted row at each padded position, or A for a zero row
    position: jax.Array  # i32[A]: each sorted row's padded position
    covered: jax.Array  # bool[A]: rows within the groups (those past them come back as zeros)

    @classmethod
    def of(cls, group_sizes: jax.Array, num_rows: int, block_t: int) -> "_TileLayout":
        num_groups = group_sizes.shape[0]
        # whole tiles of all rows and a partial one an expert with rows; and never more tiles than rows
        num_tiles = min(num_rows, num_rows // block_t + min(num_groups, num_rows))
        tiles = (group_sizes + block_t - 1) // block_t  # i32[G]: each expert's row tiles
        tile_ends = jnp.cumsum(tiles)
        tile_starts = tile_ends - tiles
        rows_before = jnp.cumsum(group_sizes) - group_sizes  # i32[G]: each expert's first sorted row

        def group_of(index: jax.Array, ends: jax.Array) -> jax.Array:  # past the last end: G
            return jnp.searchsorted(ends, index, side="right", method="compare_all")

        tile_group = group_of(jnp.arange(num_tiles), tile_ends)  # i32[tiles]
        padded = jnp.arange(num_tiles * block_t)
        group = tile_group[padded // block_t]
        clipped = jnp.minimum(group, num_groups - 1)
        in_group = (padded // block_t - tile_starts[clipped]) * block_t + padded % block_t
        valid = (group < num_groups) & (in_group < group_sizes[clipped])
        source_row = jnp.where(valid, rows_before[clipped] + in_group, num_rows)

        row = jnp.arange(num_rows)
        row_group = jnp.minimum(group_of(row, jnp.cumsum(group_sizes)), num_groups - 1)
        within = row - rows_before[row_group]
        position = (tile_starts[row_group] + within // block_t) * block_t + within % block_t
        covered = row < group_sizes.sum()
        return cls(tile_group, source_row, jnp.where(covered, position, 0), covered)


def _kernel(group_ref, x_ref, values_ref, scale_ref, out_ref, *, num_groups: int, block_t: int, block_n: int,
            block_k: int, steps: int, scale_each_step: bool) -> None:
    """One program: its row tile times its expert's output tile [block_n], over the contracted axis in `steps`
    steps of `block_k` rows (module docstring); tiles past the ones in use do nothing."""
    tile, n_tile = pl.program_id(0), pl.program_id(1)
    group = group_ref[tile]
    rows = pl.ds(pl.multiple_of(tile * block_t, block_t), block_t)
    columns = pl.ds(pl.multiple_of(n_tile * block_n, block_n), block_n)

    @pl.when(group < num_groups)
    def _multiply() -> None:
        def body(step, acc):  # acc: f32[block_t, block_n]
            contracted = pl.ds(pl.multiple_of(step * block_k, block_k), block_k)
            x = x_ref[rows, contracted]  # [block_t, block_k]
            w = values_ref[group, contracted, columns].astype(x.dtype)  # e4m3 widened in registers
            product = jnp.dot(x, w, preferred_element_type=jnp.float32)
            if scale_each_step:
                product = product * scale_ref[group, pl.ds(step, 1), columns]  # * f32[1, block_n]
            return acc + product

        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((block_t, block_n), jnp.float32))
        if not scale_each_step:
            acc = acc * scale_ref[group, pl.ds(0, 1), columns]
        out_ref[rows, columns] = acc


def fp8_grouped_matmul(
    rows: jax.Array,  # [A, K] sorted by group, in float32, float16 or bfloat16
    values: jax.Array,  # f8e4m3fn[G, K, N]
    scale: jax.Array,  # f32[G, K / block, N], or f32[G, 1, N] (a scale per channel)
    block: int,  # contracted rows a scale covers (K or more for a scale per channel)
    group_sizes: jax.Array,  # i32[G]: rows of each group, in order; rows past their sum come back as zeros
    *,
    interpret: bool = False,
    num_warps: int = 4,
    num_stages: int = 3,
) -> jax.Array:  # f32[A, N]
    """rows[group g] @ (values[g] scaled by scale[g]) for every group, float32 sums (module docstring)."""
    if plgpu is None and not interpret:
        raise RuntimeError("this jax has no Pallas Triton backend")
    num_rows, k = rows.shape
    num_groups, _, n = values.shape
    block_k = contracted_tile(k, block)
    per_channel = scale.shape[1] == 1
    if (block_k is None or n % _WIDTHS[-1] or values.shape[1] != k or group_sizes.shape != (num_groups,)
            or scale.shape != (num_groups, 1 if per_channel else k // block, n)):
        raise ValueError(f"fp8_grouped_matmul: rows {rows.shape}, values {values.shape}, scale {scale.shape}, "
                         f"block {block}, group_sizes {group_sizes.shape}")
    block_t = min(_MAX_BLOCK_T, max(_MIN_DOT_DIM, next_pow2(pl.cdiv(num_rows, num_groups))))
    block_n = next(width for width in _WIDTHS if n % width == 0)
    layout = _TileLayout.of(group_sizes, num_rows, block_t)
    padded = jnp.concatenate([rows, jnp.zeros((1, k), rows.dtype)])[layout.source_row]  # [tiles * block_t, K]
    kernel = functools.partial(_kernel, num_groups=num_groups, block_t=block_t, block_n=block_n, block_k=block_k,
                               steps=k // block_k, scale_each_step=not per_channel)
    whole = pl.BlockSpec()  # the kernel indexes these itself
    out = pl.pallas_call(
        kernel,
        grid=(layout.tile_group.shape[0], n // block_n),  # the first axis varies fastest in launch order
        in_specs=[whole] * 4,
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((padded.shape[0], n), jnp.float32),
        compiler_params=None if plgpu is None else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="fp8_grouped_matmul",
    )(layout.tile_group, padded, values, scale)  # f32[tiles * block_t, N]
    return jnp.where(layout.covered[:, None], out[layout.position], 0.0)
