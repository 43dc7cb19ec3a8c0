"""x @ w with both operands in e4m3 and block scales (W8A8: DeepSeek-V3's 1 x 128 activation groups, an FP8
checkpoint's `weight_block_size`), on Hopper's FP8 tensor cores, as a Pallas Mosaic GPU kernel.

Why a Mosaic GPU kernel. The Triton block kernel (`fp8_block_matmul`) runs an e4m3 x e4m3 dot on Ada's FP8
MMA, but on Hopper Triton declines wgmma for it (Pallas sets no `max_num_imprecise_acc`) and widens both
operands to float16 `mma.sync`, below the kernel's own bfloat16 wgmma over 16-bit rows. Mosaic GPU issues
the wgmma itself: `wgmma.mma_async ... .e4m3.e4m3` at twice the bfloat16 rate.

Layout. Hopper's FP8 wgmma reads both operands K-major, with no transposed form: the rows x [T, K] are, and
the weight must be stored [N, K], one output channel's contracted values contiguous, as checkpoints store a
linear layer's weight (`values_t`; `models/fp8_layout.py` stores them so). Its scales stay [K / block, N]; the
rows' scales [T, K / block] are transposed before the kernel, so that a tile's scales for one block of
contracted columns are one contiguous run.

Work split. The grid is (row tile, output tile); a program computes a [64 * consumers, block_n] tile, each
consumer warpgroup 64 rows of it, all of them reading the same weight tile. A memory warpgroup walks the
contracted axis one scale block (`block` = 128 columns: four k32 wgmmas) at a time, filling a ring of `stages`
shared-memory stages by TMA ahead of the tensor cores (`plgpu.emit_pipeline_warp_specialized`): the rows' values
and scales, the weight's values and scales. Each block's e4m3 product is summed in float32 in a fresh wgmma
accumulator, which is then scaled by its rows' scales and its outputs' scales and added to the tile's float32
total in registers: the block scales apply per block, before the blocks are summed (DeepGEMM's promotion of the
tensor cores' partial sums, here at every block). The total is written once, in `out_dtype`, through shared
memory.

Ping-pong (`ping_pong`, two consumers, two stages or more). A consumer's promotion (two multiplies and an add a
value, about half as long as its block's wgmmas) leaves the tensor cores idle where both consumers promote at
once. So they take turns, FlashAttention-3's ping-pong: both meet at a rendezvous barrier after issuing their
wgmmas and again after promoting, the second consumer a meeting behind the first. The consumers then issue
their blocks' wgmmas in turn, and each promotes while the other's product, issued behind its own, is on the
tensor cores. With one stage the meetings would wait on the stage's refill and the refill on them, so a ring of
one stage with blocks to refill it walks side by side.

Needs: K a multiple of `block` = 128 (one 128-byte swizzle of e4m3), N a multiple of 64; rows of any count
(padded to whole row tiles). The kernel also runs in Mosaic GPU's interpreter on a CPU (`interpret=`, jax >=
0.11), which the tests check against float64; jaxlib >= 0.12 compiles it deviceless for an H100 (the tests
read its PTX).

Race detection: jax 0.12.1's Mosaic GPU interpreter reports the memory warpgroup's refill of a stage as racing
with a consumer's plain read of it a ring earlier (here the scales'; the tensor cores' reads it does not track),
and reports the same of the smallest use of `emit_pipeline_warp_specialized`: one consumer summing its stages
with plain loads, the pipeline's own barriers between them, the pattern of JAX's Hopper mixed-type matmul. The
kernel's tests run without it; the oracle test at a served shape on a Hopper GPU (32 blocks through 4 stages)
is the check on the device.
"""

import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxserve.ops.mosaic_gpu_lowering import interpreter, remember_ptxas_version

ROWS_PER_WARPGROUP = 64  # wgmma's M
BLOCK = 128  # contracted columns a scale covers; one 128-byte swizzle of e4m3
SWIZZLE = 128
_BLOCK_N = (128, 64)  # output tiles, the widest first
_DEFAULT_NUM_SMS = 132  # an H100 SXM
_WAVES = 2  # aim for this many programs per multiprocessor
DEFAULT_STAGES = 4
DEFAULT_CONSUMERS = 2
MEMORY_REGISTERS = 40  # the memory warpgroup's: it only issues copies
FP8 = jnp.float8_e4m3fn
remember_ptxas_version()  # the lowering's question to ptxas, asked once a process (mosaic_gpu_lowering.py)


def fits(k: int, n: int, block: int) -> bool:
    """Whether a [rows, k] x [k, n] product with scales per `block` contracted columns is the kernel's."""
    return block == BLOCK and k % block == 0 and n % _BLOCK_N[-1] == 0


def block_n_for(rows: int, n: int, tile_m: int, num_sms: int = _DEFAULT_NUM_SMS) -> int:
    """The widest output tile that gives every multiprocessor `_WAVES` programs, else the narrowest."""
    row_tiles = pl.cdiv(rows, tile_m)
    widths = [b for b in _BLOCK_N if n % b == 0]
    return next((b for b in widths if n // b * row_tiles >= _WAVES * num_sms), widths[-1])


def _swizzled(dtype) -> dict:
    """The transforms of a shared-memory tile wgmma reads: 8 rows by 128 bytes, swizzled."""
    columns = SWIZZLE // jnp.dtype(dtype).itemsize
    return dict(transforms=(plgpu.TilingTransform((8, columns)), plgpu.SwizzleTransform(SWIZZLE)))


def _load(ref, layout) -> jax.Array:
    """A shared-memory vector into registers in `layout` (jax 0.10 and 0.11 take an index, 0.12 does not)."""
    if "idx" in inspect.signature(plgpu.load).parameters:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def _kernel(x_gmem, x_scale_gmem, values_gmem, scale_gmem, out_gmem, out_smem, *turns, block_n: int, blocks: int,
            stages: int, consumers: int) -> None:
    """One program: output tile [64 * consumers, block_n] at (row tile, output tile), a warpgroup of 64 rows
    each consumer, and a memory warpgroup that keeps the ring of stages filled (module docstring). `turns`:
    (the consumers' rendezvous barrier,) with ping-pong, else ()."""
    tile_m = ROWS_PER_WARPGROUP * consumers
    rows = pl.ds(lax.axis_index("rows") * tile_m, tile_m)
    columns = pl.ds(lax.axis_index("columns") * block_n, block_n)
    wg = lax.axis_index("wg")
    own = pl.ds(wg * ROWS_PER_WARPGROUP, ROWS_PER_WARPGROUP)  # a consumer's rows within the tile

    def take_turn() -> None:  # both consumers arrive before either goes on
        plgpu.barrier_arrive(turns[0])
        plgpu.barrier_wait(turns[0])

    def step(_, x_smem, x_scale_smem, values_smem, scale_smem, total):
        # x_smem: e4m3[tile_m, 128]; values_smem: e4m3[block_n, 128] (K-major); x_scale_smem: f32[1, tile_m];
        # scale_smem: f32[1, block_n]; total: f32[64, block_n], this consumer's
        x_scale = _load(x_scale_smem.at[0, own], plgpu.Layout.WGMMA.reduce(1))  # f32[64], a row's each
        scale = _load(scale_smem.at[0], plgpu.Layout.WGMMA.reduce(0))  # f32[block_n], a column's each

        def product(acc_ref):
            plgpu.wgmma(acc_ref, x_smem.at[own], values_smem.T)
            if turns:  # issued (behind the other's, on the tensor cores): the other may promote its product
                take_turn()
            return acc_ref[...]

        partial = pl.run_scoped(product, plgpu.ACC((ROWS_PER_WARPGROUP, block_n), jnp.float32))
        scales = lax.broadcast_in_dim(x_scale, partial.shape, [0]) * lax.broadcast_in_dim(scale, partial.shape, [1])
        total = total + partial * scales
        if turns:  # promoted: the other, its product issued, may wait for it and promote while this one's next runs
            total = lax.optimization_barrier(total)  # keeps the promotion before the arrival
            take_turn()
        return total

    def each_consumer(pipeline) -> None:
        zeros = plgpu.layout_cast(jnp.zeros((ROWS_PER_WARPGROUP, block_n), jnp.float32), plgpu.Layout.WGMMA)
        if turns:  # the second consumer starts a turn behind the first
            pl.when(wg == 1)(take_turn)
        total = pipeline(zeros)  # f32[64, block_n]
        if turns:  # and the first ends a turn after it: both arrived 2 x blocks + 1 times
            pl.when(wg == 0)(take_turn)
        out_smem[wg] = total.astype(out_smem.dtype)
        plgpu.commit_smem()  # the stores visible to the TMA engine
        plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[rows].at[own, columns])
        plgpu.wait_smem_to_gmem(0)

    specs = [
        plgpu.BlockSpec((tile_m, BLOCK), lambda kb: (0, kb), **_swizzled(FP8)),
        plgpu.BlockSpec((1, tile_m), lambda kb: (kb, 0)),
        plgpu.BlockSpec((block_n, BLOCK), lambda kb: (0, kb), **_swizzled(FP8)),
        plgpu.BlockSpec((1, block_n), lambda kb: (kb, 0)),
    ]
    pipeline = plgpu.emit_pipeline_warp_specialized(
        step, grid=(blocks,), in_specs=specs, max_concurrent_steps=min(stages, blocks), wg_axis="wg",
        num_compute_wgs=consumers, memory_registers=MEMORY_REGISTERS, compute_context=each_consumer)
    pipeline(x_gmem.at[rows], x_scale_gmem.at[:, rows], values_gmem.at[columns], scale_gmem.at[:, columns])


def fp8_block_matmul_mgpu(
    x: jax.Array,  # e4m3[T, K]
    x_scale: jax.Array,  # f32[T, K / block]: column k of row t is scaled by x_scale[t, k // block]
    values_t: jax.Array,  # e4m3[N, K]: the weight K-major (a checkpoint's [out, in])
    scale: jax.Array,  # f32[K / block, N]: value [n, k] is scaled by scale[k // block, n]
    block: int,
    *,
    out_dtype: jnp.dtype = jnp.bfloat16,
    num_sms: int = _DEFAULT_NUM_SMS,
    stages: int = DEFAULT_STAGES,
    consumers: int = DEFAULT_CONSUMERS,  # warpgroups of 64 rows a program, sharing each weight tile
    ping_pong: bool = True,  # two consumers take turns on the tensor cores (module docstring)
    interpret: bool | object = False,  # True: Mosaic GPU's interpreter (jax >= 0.11); or its params
) -> jax.Array:  # [T, N] in out_dtype
    """(x scaled by its blocks' scales) @ (values_t scaled by their blocks' scales).T, float32 sums, on
    Hopper's FP8 wgmma (module docstring)."""
    rows, k = x.shape
    n = values_t.shape[0]
    if (not fits(k, n, block) or x.dtype != FP8 or values_t.dtype != FP8 or values_t.shape != (n, k)
            or scale.shape != (k // block, n) or x_scale.shape != (rows, k // block)):
        raise ValueError(f"fp8_block_matmul_mgpu: x {x.shape} {x.dtype}, x_scale {x_scale.shape}, values_t "
                         f"{values_t.shape} {values_t.dtype}, scale {scale.shape}, block {block}")
    tile_m = ROWS_PER_WARPGROUP * consumers
    block_n = block_n_for(rows, n, tile_m, num_sms)
    row_tiles = pl.cdiv(rows, tile_m)
    padded = row_tiles * tile_m
    x = jnp.pad(x, ((0, padded - rows), (0, 0)))
    x_scale_t = jnp.pad(x_scale.T.astype(jnp.float32), ((0, 0), (0, padded - rows)))  # f32[K / block, T_padded]
    blocks = k // block
    kernel = functools.partial(_kernel, block_n=block_n, blocks=blocks, stages=stages, consumers=consumers)
    # With one stage and blocks to refill it, the turns would wait on each other across the refill: a deadlock.
    turns_fit = consumers == 2 and (blocks == 1 or min(stages, blocks) >= 2)
    turns = [plgpu.Barrier(num_arrivals=consumers)] if ping_pong and turns_fit else []
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((padded, n), out_dtype),
        scratch_types=[plgpu.SMEM((consumers, ROWS_PER_WARPGROUP, block_n), out_dtype), *turns],  # each consumer's tile
        grid=(row_tiles, n // block_n),
        grid_names=("rows", "columns"),
        num_threads=consumers + 1,
        thread_name="wg",
        interpret=interpreter(interpret),
    )(x, x_scale_t, values_t, scale.astype(jnp.float32))
    return out[:rows]
