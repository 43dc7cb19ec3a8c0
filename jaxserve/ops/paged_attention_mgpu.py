"""Ragged paged attention for Hopper (sm_90) as a Pallas Mosaic GPU kernel: TMA page loads, wgmma on the
tensor cores, a producer warpgroup that streams K/V pages while consumer warpgroups compute.

The Triton kernels (`paged_attention_pallas`) serve every CUDA GPU from sm_80; this one serves the prefill
and mixed steps of Hopper GPUs, where Triton's dots reach a few percent of the tensor cores' peak, and their
decode-only steps where `AttentionConfig.mosaic_decode` says so (by default with jaxlib >= 0.12).

Work split. A program serves one query block of one request and one KV head: a slab of `block_q`
consecutive tokens times the G query heads that share the KV head, `block_q * G_pad = 64 * consumers`
rows, head-major (row r is head r // block_q's token r % block_q), so each K/V page read serves the whole
GQA group. Queries are read and outputs written in place in [T, N, H] (a slab of one head is a strided
2-D box for TMA); a slab starts on a tile of 8 tokens, so it may begin before the request's first token or
end past its last: those rows are computed and never stored. The grid is (block, KV head); the blocks
past the step's requests exit at once. With `programs_per_kv_head`, a persistent grid: as many programs a KV
head (the multiprocessors over the KV heads: one wave), each walking its share of the blocks with one ring of
stages, so a program's fill (its description, queries, first pages) and drain (the last P V, the store) are
paid once a program and overlap the next block's, not once a block (`one_wave` gives the count).

Launch order. A GPU starts a kernel's programs in the order of their index, the KV head fastest here, and
a program's cost is its steps over the keys, which vary: a causal prefill's last block walks every key
before it, its first one step; a long decode walks many pages, a short one few. With `heavy_first` (the
default) the blocks are described in order of their steps, the most first, so the long programs start in
the first wave and the short ones fill in behind them, longest-processing-time-first list scheduling, as
FlashAttention-2 and 3 walk causal query blocks in reverse. In the order of the requests, the heaviest
blocks of a causal prefill start last and the step ends with a tail of them on a few multiprocessors.
Decode-only steps launch in the requests' order (`DECODE_HEAVY_FIRST`), which an H200 measured faster.

Per program:
- the producer warpgroup copies the block's description to shared memory, then the slab's queries, then
  walks the block's key range `block_kv` keys at a time: it waits until the consumers have freed a stage
  and issues one TMA copy per page (page ids read from the page table) into the stage's K and V buffers;
- each consumer warpgroup (64 rows) computes S = Q K^T (wgmma, float32 accumulators), masks it (causal,
  the request's length, a sliding window), runs the online softmax in the log2 domain, writes P in the
  model's dtype to shared memory and accumulates P V (wgmma); then it normalises its rows and stores
  them, a head's slab at once when the slab is all the block's, else in power-of-two runs; with attention
  sinks (GPT-OSS), each row's sink joins its denominator there, exp(sink - max) (`_row_sinks`);
- with `ping_pong` (two consumers), the consumers take turns on the tensor cores, FlashAttention-3's
  ping-pong schedule: a barrier that both arrive at orders one's softmax under the other's two GEMMs. Both
  walk the same steps (the program's key range), so their turns always pair up;
- with `overlap`, each consumer hides its softmax under its own tensor cores' work, FlashAttention-3's
  intra-warpgroup pipelining: it issues step j + 1's Q K^T, then step j's P V, waits for the first only,
  and runs step j + 1's softmax while P V goes on (`_overlapped_steps`); with `ping_pong` too, the
  consumers take turns issuing each round of GEMMs, as FlashAttention-3 runs both.

Whole pages are loaded, so the slots past a request's length are read: they must hold finite values, which
the engine guarantees (a fresh cache is zeros, freed pages keep finite K/V, padding writes are dropped).
Their scores are masked before the softmax and their P is exactly 0, so they never reach the output.

An FP8 cache (e4m3, its per-layer scales folded into the weights: `models/kv_scales.py`) is read as it is
stored, half a 16-bit cache's bytes: the producer's TMA copies land the pages in FP8 staging buffers, and
the producer widens each stage to the queries' dtype in the K and V buffers the consumers read (e4m3 to
float16 in hardware, `cvt.f16x2.e4m3x2`, then to bfloat16: sm_90 has no direct e4m3 -> bfloat16 convert),
a stage behind its copies (`_producer_block`), so a ring of FP8 stages stays in flight. The consumers'
program is the 16-bit one; e4m3 values are exact in float16 and bfloat16, so the kernel computes what a
16-bit cache of the same values gives.

Needs: a head dim that is a multiple of 64, pages of a multiple of 8 tokens that divide `block_kv`, queries
in float16 or bfloat16 and a cache of the same dtype or FP8 e4m3. The kernel also runs in Mosaic
GPU's interpreter on a CPU (`interpret=`, jax >= 0.11), which the tests check against the float64 oracle.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxserve.ops.mosaic_gpu_lowering import interpreter, remember_ptxas_version
from jaxserve.ops.paged_attention_pallas import (
    FP8_CACHE_DTYPES,
    LOG2_E,
    MASK_VALUE,
    ScoreRule,
    heaviest_first,
    next_pow2,
)
from jaxserve.ops.paged_attention_pallas import SEARCH_METHOD as _SEARCH

remember_ptxas_version()  # the lowering's question to ptxas, asked once a process (mosaic_gpu_lowering.py)

ROWS_PER_WARPGROUP = 64  # wgmma's M per warpgroup
HOPPER_SMEM_BYTES = 232_448  # an H100's or H200's shared memory a block may opt into
_SMEM_SPARE = 1024  # the description, barriers and alignment
_BARRIER_BYTES = 256  # a persistent grid's: room kept beside its descriptions for the barriers
# Prefill and mixed steps, as measured on an H200 (docs/benchmarks.md; every configuration matched the
# reference there): P in registers, 5-7% faster than through shared memory; the ping-pong schedule, 12-13%
# less time on chunks after 4k-8k keys and the same on a 2k prefill. The overlapped softmax was slower on
# every case and stays opt-in.
DEFAULTS = dict(num_consumers=2, block_kv=128, stages=2, p_in_registers=True, ping_pong=True, overlap=False)
# For decode-only steps (`AttentionConfig.mosaic_decode`): a program per request and KV head, the GQA
# group's rows in one warpgroup, launched in the requests' order (`DECODE_HEAVY_FIRST`). On an H200 this
# read K/V at 66-73% of HBM bandwidth, within 0.4% of the best of the sweep's configurations on each case.
DECODE_DEFAULTS = dict(num_consumers=1, block_kv=128, stages=2)
# Decodes' programs differ in length by their requests' keys alone, and on an H200 the requests' order took
# 2.5-10% less time than the heaviest first (docs/benchmarks.md), which prefills keep.
DECODE_HEAVY_FIRST = False
# The grid's blocks are CUDA's y axis (the KV heads its x: `_kernel`'s launch order), which holds at most this.
MAX_GRID_Y = 65_535
MGPU_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# A program's description: one row of i32[NB, _INFO], copied to shared memory (scalars read from there can
# start a slice; the page ids are read from the page table in global memory).
_REQ, _SLAB_TILE, _SLAB_POS, _SHIFT, _NUM_VALID, _KV_LEN, _FIRST_STEP, _END_STEP = range(8)
_INFO = 32  # ints a row: padded to 128 bytes, a copy that a warpgroup's 128 threads divide (jax 0.10)
# A slab starts at a multiple of this many tokens, a tile of the shared-memory layout (Mosaic GPU's layout
# inference accepts a copy's dynamic start only where it can prove that).
_SLAB_ALIGN = 8


def shared_memory_bytes(
    head_dim: int, num_consumers: int, block_kv: int, stages: int, p_in_registers: bool = False, itemsize: int = 2,
    fp8: bool = False,
) -> int:
    """The kernel's buffers: per consumer its queries, P (unless in registers) and output; per stage a K and
    a V block, and with an `fp8` cache their FP8 staging buffers."""
    rows = num_consumers * ROWS_PER_WARPGROUP
    p_cols = 0 if p_in_registers else block_kv
    staging = 2 * stages * block_kv * head_dim if fp8 else 0  # one byte an element
    return (rows * (2 * head_dim + p_cols) + 2 * stages * block_kv * head_dim) * itemsize + staging + _SMEM_SPARE


def supports(
    q_dtype, cache_dtype, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
    num_consumers: int = DEFAULTS["num_consumers"], block_kv: int = DEFAULTS["block_kv"],
    stages: int = DEFAULTS["stages"], p_in_registers: bool = False, ping_pong: bool = False,
    overlap: bool = False, persistent: bool = False, smem_limit: int = HOPPER_SMEM_BYTES,
) -> str | None:
    """Why this kernel cannot serve a shape (None when it can): the caller then takes the Triton kernel."""
    fp8 = jnp.dtype(cache_dtype) in FP8_CACHE_DTYPES
    if jnp.dtype(q_dtype) not in MGPU_DTYPES or not (fp8 or jnp.dtype(cache_dtype) == jnp.dtype(q_dtype)):
        return (f"queries {jnp.dtype(q_dtype).name} and cache {jnp.dtype(cache_dtype).name} (float16 or bfloat16, "
                "the cache alike or FP8 e4m3)")
    if head_dim % 64:
        return f"head dim {head_dim} (a multiple of 64)"
    if block_kv % 64:
        return f"block_kv {block_kv} (a multiple of 64: P's shared-memory tiles are 64 keys wide)"
    if page_size % 8 or block_kv % page_size:
        return f"page size {page_size} (a multiple of 8 that divides {block_kv})"
    if num_consumers not in (1, 2):
        return f"{num_consumers} consumer warpgroups (1 or 2)"
    if ping_pong and num_consumers != 2:
        return f"the ping-pong schedule on {num_consumers} consumer warpgroup(s) (it takes 2)"
    if overlap and persistent:
        return "the overlapped softmax on a persistent grid (only the plain steps free the queries' buffer)"
    if overlap and head_dim > 128:
        return f"the overlapped softmax at head dim {head_dim} (two steps' scores and the output in registers: 128)"
    if next_pow2(num_q_heads // num_kv_heads) * 8 > num_consumers * ROWS_PER_WARPGROUP:
        return f"{num_q_heads // num_kv_heads} query heads per KV head (a block holds at least 8 tokens)"
    if (need := shared_memory_bytes(head_dim, num_consumers, block_kv, stages, p_in_registers, fp8=fp8)) > smem_limit:
        return f"head dim {head_dim} at block_kv {block_kv} x {stages} stages ({need} bytes of shared memory)"
    return None


def config_for(
    decode_only: bool, q_dtype, cache_dtype, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
    persistent: bool = False,
) -> dict[str, Any] | None:
    """The kernel's settings for a step (`DECODE_DEFAULTS` for decode-only steps, else `DEFAULTS`), `block_kv`
    halved (down to 64) where the defaults' buffers pass the shared memory (an FP8 cache's staging buffers
    do at the prefill defaults); None where the kernel cannot serve the shape at all."""
    config = dict(DECODE_DEFAULTS if decode_only else DEFAULTS)
    fp8 = jnp.dtype(cache_dtype) in FP8_CACHE_DTYPES
    buffers = {k: v for k, v in config.items() if k in ("num_consumers", "stages", "p_in_registers")}
    while config["block_kv"] > 64 and shared_memory_bytes(
            head_dim, block_kv=config["block_kv"], fp8=fp8, **buffers) > HOPPER_SMEM_BYTES:
        config["block_kv"] //= 2
    shape = (q_dtype, cache_dtype, num_q_heads, num_kv_heads, head_dim, page_size)
    return config if supports(*shape, **config, persistent=persistent) is None else None


def _swizzled(shape: tuple[int, ...], dtype, swizzle: int = 128) -> plgpu.SMEM:
    """A shared-memory buffer in the layout wgmma reads: tiles of 8 rows by `swizzle` bytes (64 elements of
    16 bits at the default 128), swizzled."""
    columns = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, columns)), plgpu.SwizzleTransform(swizzle)))


# FP8 staging buffers: tiles of 64 e4m3 values (64-byte swizzle), so a 64 x 64 piece of a stage is whole
# tiles of both it and the 16-bit buffer it widens into, and a piece's values fit the producer's registers.
_FP8_SWIZZLE = 64
_WIDEN_PIECE = 64


def _widen(fp8_smem, dst_smem) -> None:
    """Copies a stage's FP8 K or V block [S, H] into its 16-bit buffer, widened (e4m3 -> float16 in
    hardware, then to bfloat16 where that is the queries' dtype), 64 x 64 values at a time."""
    block_kv, head_dim = fp8_smem.shape
    for r in range(0, block_kv, _WIDEN_PIECE):
        for c in range(0, head_dim, _WIDEN_PIECE):
            rows, cols = pl.ds(r, _WIDEN_PIECE), pl.ds(c, _WIDEN_PIECE)
            piece = fp8_smem[rows, cols].astype(jnp.float16)
            dst_smem[rows, cols] = piece.astype(dst_smem.dtype)


def _pieces(wg: int, group: int, block_q: int) -> list[tuple[int, int, int, int]]:
    """Warpgroup `wg`'s rows as (query head in the group, first token in the block, first row in the
    warpgroup, rows): rows are head-major, row r is head r // block_q's token r % block_q."""
    first, last = wg * ROWS_PER_WARPGROUP, (wg + 1) * ROWS_PER_WARPGROUP
    pieces = []
    for g in range(group):
        lo, hi = max(first, g * block_q), min(last, (g + 1) * block_q)
        if lo < hi:
            pieces.append((g, lo - g * block_q, lo - first, hi - lo))
    return pieces


def _consumer(o_ref, sinks_ref, info, *buffers_and_barriers, registers: int, **static):
    """Consumer warpgroup `wg`'s program: its blocks in turn (`_walk_blocks`)."""
    plgpu.set_max_registers(registers, action="increase")  # S, P and the accumulators (`_consumer_registers`)
    _walk_blocks(info, lambda row, i, done: _consumer_block(o_ref, sinks_ref, row, done, *buffers_and_barriers,
                                                            **static))
    if info.ndim == 2:  # a persistent grid's blocks waited only for their stores' reads
        plgpu.wait_smem_to_gmem(0)


def _walk_blocks(info, block: Callable[[Any, Any, Any], None]) -> None:
    """Calls `block(row, i, done)` for each used description of the program's `info` in shared memory:
    i32[_INFO], one block, or a persistent grid's i32[M, _INFO], the used ones first; `row`: block i's
    description, `done`: the program's steps before it, which place its steps in the ring of stages.
    Unused blocks (past the step's requests) are skipped."""
    if info.ndim == 1:
        pl.when(info[_NUM_VALID] > 0)(lambda: block(info, 0, 0))
        return

    def body(i, done):
        pl.when(info[i, _NUM_VALID] > 0)(lambda: block(info.at[i], i, done))
        return done + info[i, _END_STEP] - info[i, _FIRST_STEP]  # 0 for an unused block

    lax.fori_loop(0, info.shape[0], body, jnp.int32(0))


def _row_sinks(sinks_ref, row: jax.Array, *, wg: int, group: int, block_q: int) -> jax.Array:
    """Each of warpgroup `wg`'s rows' attention-sink logit in the log2 domain, f32[rows] (the row sums'
    layout): its query head's, read from `sinks_ref` (gmem f32[N]); MASK_VALUE on the rows of padding heads.
    `row`: i32[rows, S], the row index in the scores' layout."""
    head = (wg * ROWS_PER_WARPGROUP + row) // block_q  # the query head in the group, each row's
    first_head = lax.axis_index("kv_head") * group
    sinks = plgpu.layout_cast(jnp.full(row.shape, MASK_VALUE, jnp.float32), plgpu.Layout.WGMMA)
    for g, *_ in _pieces(wg, group, block_q):
        sinks = jnp.where(head == g, sinks_ref[first_head + g] * LOG2_E, sinks)
    return sinks.max(axis=1)


def _consumer_block(
    o_ref,  # gmem [T, N, H]
    sinks_ref,  # gmem f32[N], or None: no attention sinks
    info, done, q_smem, k_smem, v_smem, p_smem, o_smem,  # info: this block's description; done: the steps before
    q_bars, k_bars, v_bars, k_free, v_free, q_free, turns,  # q_free: the queries' buffer is free (persistent grid)
    *,
    wg: int,
    group: int,
    block_q: int,
    stages: int,
    block_kv: int,
    scores: ScoreRule,
    p_in_registers: bool,
    overlap: bool,
):
    kv_head = lax.axis_index("kv_head")
    rows, head_dim = ROWS_PER_WARPGROUP, q_smem.shape[-1]
    slab_pos, kv_len = info[_SLAB_POS], info[_KV_LEN]
    first_step, end_step = info[_FIRST_STEP], info[_END_STEP]
    plgpu.barrier_wait(q_bars[wg])
    q_wg, o_wg = q_smem.at[wg], o_smem.at[wg]
    p_wg = None if p_in_registers else p_smem.at[wg]  # P's buffer is then a placeholder

    row = plgpu.broadcasted_iota(jnp.int32, (rows, block_kv), 0, layout=plgpu.Layout.WGMMA)
    col = plgpu.broadcasted_iota(jnp.int32, (rows, block_kv), 1, layout=plgpu.Layout.WGMMA)
    row_pos = slab_pos + (wg * rows + row) % block_q  # i32[rows, S]: each row's token position

    def take_turn():  # both consumers arrive before either goes on
        plgpu.barrier_arrive(turns)
        plgpu.barrier_wait(turns)

    def softmax(s, m, denom, step, masked: bool):
        """Step `step`'s scores S f32[rows, S] -> (P f32[rows, S], the new running max, the factor alpha that
        rescales what was summed before, the new row sums); m and the sums f32[rows], m in the log2 domain."""
        s = scores.log2_scores(s)
        if masked:
            key_pos = step * block_kv + col
            visible = (key_pos <= row_pos) & (key_pos < kv_len)
            if scores.sliding_window is not None:
                visible &= key_pos > row_pos - scores.sliding_window
            s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        if masked:
            p = jnp.where(visible, p, 0.0)  # a row with no key visible yet keeps a zero sum
        alpha = jnp.exp2(m - m_new)
        return p, m_new, alpha, denom * alpha + p.sum(axis=1)

    def step_body(step, carry, masked: bool):
        m, denom, acc = carry  # f32[rows] (log2 domain), f32[rows], f32[rows, H]
        slot = lax.rem(done + step - first_step, stages)
        plgpu.barrier_wait(k_bars.at[slot])

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_wg, k_smem.at[slot].T)
            if turns is not None:  # issued: the other consumer's softmax is done, its P V may go
                take_turn()
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((rows, block_kv), jnp.float32))  # f32[rows, S]
        plgpu.barrier_arrive(k_free.at[slot])
        if q_free is not None:  # the block's last Q K^T read: the producer may load the next block's queries
            pl.when(step == end_step - 1)(functools.partial(plgpu.barrier_arrive, q_free[wg]))
        p, m_new, alpha, denom = softmax(s, m, denom, step, masked)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        if p_in_registers:  # FlashAttention-3's way: P stays in registers, P V accumulates in place
            p = p.astype(q_wg.dtype)
        else:  # through shared memory, which Mosaic GPU's interpreter runs too
            p_wg[...] = p.astype(p_wg.dtype)
            plgpu.commit_smem()  # P's stores visible to the tensor cores' reads
        if turns is not None:
            # The softmax done: the other consumer's Q K^T may go, and this one's P V waits its turn (the
            # other's Q K^T issued). The optimization barrier keeps the softmax before the arrival.
            p, denom, acc = lax.optimization_barrier((p, denom, acc))
            plgpu.barrier_arrive(turns)
        plgpu.barrier_wait(v_bars.at[slot])
        if turns is not None:
            plgpu.barrier_wait(turns)
        if p_in_registers:
            acc = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p, v_smem.at[slot]))(plgpu.ACC.init(acc))
        else:

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_wg, v_smem.at[slot])
                return acc_ref[...]

            acc = acc + pl.run_scoped(pv, plgpu.ACC((rows, head_dim), jnp.float32))
        plgpu.barrier_arrive(v_free.at[slot])
        return m_new, denom, acc

    init = (
        plgpu.layout_cast(jnp.full((rows,), MASK_VALUE, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        plgpu.layout_cast(jnp.zeros((rows, head_dim), jnp.float32), plgpu.Layout.WGMMA),
    )
    # Steps wholly below every row's position (and inside the request) need no mask: a prefill's steps
    # before its diagonal, all but the last one or two. Rows outside the block's tokens may then see keys
    # past their own position; they are never stored. A window masks every step.
    first_pos = slab_pos + info[_SHIFT]  # the block's first token's position, its lowest
    unmasked_end = first_step if scores.sliding_window is not None else (first_pos + 1) // block_kv
    unmasked_end = jnp.clip(unmasked_end, first_step, end_step)
    if turns is not None and wg == 1:  # the second consumer starts a turn behind the first
        take_turn()
    if overlap:
        m, denom, acc = _overlapped_steps(
            init, softmax, done, first_step, unmasked_end, end_step, q_smem, q_wg, k_smem, v_smem, p_wg, k_bars, v_bars,
            k_free, v_free, stages=stages, p_in_registers=p_in_registers,
            issued=take_turn if turns is not None else None)
    else:
        carry = lax.fori_loop(first_step, unmasked_end, functools.partial(step_body, masked=False), init)
        m, denom, acc = lax.fori_loop(unmasked_end, end_step, functools.partial(step_body, masked=True), carry)
    if turns is not None and wg == 0:  # and the first ends a turn after it: both arrived equally often
        take_turn()
    if sinks_ref is not None:
        # A key that weighs no value: its exp joins the sums (the same quotient as the Triton kernels', which
        # start the softmax from it)
        denom = denom + jnp.exp2(_row_sinks(sinks_ref, row, wg=wg, group=group, block_q=block_q) - m)
    denom = jnp.where(denom == 0.0, 1.0, denom)
    o_wg[...] = (acc / lax.broadcast_in_dim(denom, acc.shape, [0])).astype(o_wg.dtype)
    plgpu.commit_smem()

    # Store the rows of the block's own tokens in place: a whole slab per head when every token is the
    # request's, else in power-of-two runs (the rest of the slab belongs to other blocks).
    slab_start, shift, num_valid = info[_SLAB_TILE] * _SLAB_ALIGN, info[_SHIFT], info[_NUM_VALID]
    whole = (shift == 0) & (num_valid == block_q)
    for g, first_token, first_row, num_rows in _pieces(wg, group, block_q):
        rows_smem = o_wg.at[pl.ds(first_row, num_rows)]
        head_gmem = o_ref.at[pl.ds(slab_start + first_token, num_rows), kv_head * group + g]
        pl.when(whole)(functools.partial(plgpu.copy_smem_to_gmem, rows_smem, head_gmem))
        own = (jnp.maximum(shift - first_token, 0), jnp.minimum(shift + num_valid - first_token, num_rows))
        pl.when(~whole)(functools.partial(_store_tokens, rows_smem, head_gmem, *own))
    # A persistent grid's next block rewrites the output buffer once the stores have read it; the last one's
    # are waited for at the program's end (`_consumer`)
    plgpu.wait_smem_to_gmem(0, wait_read_only=q_free is not None)


def _overlapped_steps(
    init, softmax, done, first_step, unmasked_end, end_step,  # softmax: the consumer's (scores, m, sums, step, masked)
    q_smem, q_wg, k_smem, v_smem, p_wg, k_bars, v_bars, k_free, v_free, *, stages: int, p_in_registers: bool,
    issued: Callable[[], None] | None = None,
):
    """The consumer's steps with its softmax under its own tensor cores' work, FlashAttention-3's
    intra-warpgroup pipelining: step j's P V is issued right after step j + 1's Q K^T, and step j + 1's
    softmax runs while P V is under way (a wgmma waits only for the groups issued before the last one).
    The first step's scores come alone, masked (exact for the rows that are stored), and the last P V
    alone. `issued`: called once each round of GEMMs is issued (the ping-pong's turn: the other consumer's
    GEMMs go while this one's softmax runs). Returns the running max f32[rows] (log2 domain), the row sums
    f32[rows] and the unnormalised output f32[rows, H]."""
    m, denom, acc = init
    rows, block_kv = ROWS_PER_WARPGROUP, k_smem.shape[1]

    def slot_of(step):  # `done`: the program's steps before this block (a persistent grid's)
        return lax.rem(done + step - first_step, stages)

    def to_p(p):  # P where P V reads it: registers (returned), or shared memory (None)
        p = p.astype(q_wg.dtype)
        if p_in_registers:
            return p
        p_wg[...] = p
        plgpu.commit_smem()  # P's stores visible to the tensor cores' reads
        return None

    first = slot_of(first_step)
    plgpu.barrier_wait(k_bars.at[first])

    def turn() -> None:
        if issued is not None:
            issued()

    def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_wg, k_smem.at[first].T)
        turn()
        return acc_ref[...]

    s = pl.run_scoped(qk, plgpu.ACC((rows, block_kv), jnp.float32))
    plgpu.barrier_arrive(k_free.at[first])
    p, m, _, denom = softmax(s, m, denom, first_step, True)  # acc is zeros: nothing to rescale
    p = to_p(p)

    def step_body(step, carry, masked_next: bool):
        """P V of `step`, under it the softmax of `step + 1`."""
        m, denom, acc, p = carry
        slot, next_slot = slot_of(step), slot_of(step + 1)
        plgpu.barrier_wait(k_bars.at[next_slot])
        plgpu.barrier_wait(v_bars.at[slot])
        if p_in_registers:  # P V accumulates in place; the softmax's results leave through refs

            def gemms(refs):
                acc_ref, s_ref, m_ref, denom_ref, p_ref, alpha_ref = refs
                # The queries' buffer indexed in here: a constant index closed over fails jax 0.12's lowering
                plgpu.wgmma(s_ref, q_smem.at[lax.axis_index("wg")], k_smem.at[next_slot].T)
                plgpu.wgmma(acc_ref, p, v_smem.at[slot])
                turn()
                s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # Q K^T done, P V under way
                plgpu.barrier_arrive(k_free.at[next_slot])
                p_next, m_ref[...], alpha_ref[...], denom_ref[...] = softmax(s, m, denom, step + 1, masked_next)
                p_ref[...] = p_next.astype(p.dtype)

            zeros = plgpu.layout_cast(jnp.zeros((rows, block_kv), jnp.float32), plgpu.Layout.WGMMA)
            acc, _, m_new, denom, p_next, alpha = pl.run_state(gemms)(
                (plgpu.ACC.init(acc), plgpu.ACC.init(zeros), m, denom, p, m))  # waits for P V at its end
        else:  # P V into a fresh accumulator, added (Mosaic GPU's interpreter runs this form)

            def gemms(s_ref, pv_ref):
                plgpu.wgmma(s_ref, q_wg, k_smem.at[next_slot].T)
                plgpu.wgmma(pv_ref, p_wg, v_smem.at[slot])
                turn()
                s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # Q K^T done, P V under way
                plgpu.barrier_arrive(k_free.at[next_slot])
                return *softmax(s, m, denom, step + 1, masked_next), plgpu.wgmma_accumulator_load(pv_ref, wait_n=0)

            p_next, m_new, alpha, denom, pv = pl.run_scoped(
                gemms, plgpu.ACC((rows, block_kv), jnp.float32), plgpu.ACC(acc.shape, jnp.float32))
            acc = acc + pv
        plgpu.barrier_arrive(v_free.at[slot])
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        return m_new, denom, acc, to_p(p_next)

    carry = (m, denom, acc, p)
    last = end_step - 1  # the loops end at the last step: its P V comes alone
    carry = lax.fori_loop(first_step, jnp.maximum(unmasked_end - 1, first_step),
                          functools.partial(step_body, masked_next=False), carry)
    carry = lax.fori_loop(jnp.maximum(unmasked_end - 1, first_step), last,
                          functools.partial(step_body, masked_next=True), carry)
    m, denom, acc, p = carry
    slot = slot_of(last)
    plgpu.barrier_wait(v_bars.at[slot])
    if p_in_registers:

        def last_pv(acc_ref):
            plgpu.wgmma(acc_ref, p, v_smem.at[slot])
            turn()

        acc = pl.run_state(last_pv)(plgpu.ACC.init(acc))
    else:

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_wg, v_smem.at[slot])
            turn()
            return acc_ref[...]

        acc = acc + pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))
    plgpu.barrier_arrive(v_free.at[slot])
    return m, denom, acc


def _store_tokens(rows_smem, head_gmem, first: jax.Array, end: jax.Array) -> None:
    """Stores rows [first, end) of a head's slab in power-of-two runs: one TMA copy per set bit of the
    count, largest first (at most 7 copies for 64 rows; the output buffer is plain, so any row may start
    one)."""
    count = jnp.maximum(end - first, 0)
    num_rows = rows_smem.shape[0]
    for bit in reversed(range(num_rows.bit_length())):  # every 1 << bit is at most num_rows
        size = 1 << bit
        start = first + (count >> (bit + 1) << (bit + 1))  # past the runs of the higher bits
        pl.when(count & size != 0)(functools.partial(
            plgpu.copy_smem_to_gmem, rows_smem.at[pl.ds(start, size)], head_gmem.at[pl.ds(start, size)]
        ))


# Registers a thread (setmaxnreg): the producer's, which only issues copies with a 16-bit cache and widens an
# FP8 one's stages too (by whether the cache is FP8), and the consumers', which hold S, P and the accumulators
# without spills: up to 232, within what the producer leaves of the multiprocessor's 64K (`_consumer_registers`).
PRODUCER_REGISTERS = {False: 40, True: 64}
MAX_CONSUMER_REGISTERS = 232
_REGISTER_FILE = 65_536  # 32-bit registers a multiprocessor
_WARPGROUP_THREADS = 128


def _consumer_registers(num_consumers: int, fp8: bool) -> int:
    """The consumers' setmaxnreg: the register file less the producer's, shared by the consumer warpgroups
    (128 threads each), a multiple of 8, at most MAX_CONSUMER_REGISTERS (2 consumers: 232 beside a producer
    of 40, 224 beside one of 64)."""
    left = (_REGISTER_FILE - _WARPGROUP_THREADS * PRODUCER_REGISTERS[fp8]) // (_WARPGROUP_THREADS * num_consumers)
    return min(MAX_CONSUMER_REGISTERS, left // 8 * 8)


def _producer(q_ref, k_ref, v_ref, page_table_ref, info, *buffers_and_barriers, **static):
    """The producer warpgroup's program: its blocks in turn, one ring of stages across them, so the next
    block's pages load while the consumers finish this one."""
    plgpu.set_max_registers(PRODUCER_REGISTERS[static["staging"] is not None], action="decrease")
    _walk_blocks(info, lambda row, i, done: _producer_block(q_ref, k_ref, v_ref, page_table_ref, row, i, done,
                                                            *buffers_and_barriers, **static))


def _producer_block(
    q_ref, k_ref, v_ref, page_table_ref,  # gmem
    info, i, done, q_smem, k_smem, v_smem,  # info: block i's description; done: the program's steps before it
    q_bars, k_bars, v_bars, k_free, v_free, q_free,
    *,
    num_consumers: int,
    group: int,
    block_q: int,
    stages: int,
    pages_per_block: int,
    staging: tuple[Any, Any, Any, Any] | None,  # an FP8 cache's: K and V staging buffers, their copies' barriers
):
    kv_head = lax.axis_index("kv_head")
    page_size = k_ref.shape[2]
    slab_start, req = info[_SLAB_TILE] * _SLAB_ALIGN, info[_REQ]

    def load_queries():
        for w in range(num_consumers):
            if q_free is not None:  # after the program's first block: once consumer w has read its last queries
                pl.when(i > 0)(functools.partial(plgpu.barrier_wait, q_free[w]))
            for g, first_token, first_row, num_rows in _pieces(w, group, block_q):
                plgpu.copy_gmem_to_smem(
                    q_ref.at[pl.ds(slab_start + first_token, num_rows), kv_head * group + g],
                    q_smem.at[w, pl.ds(first_row, num_rows)],
                    q_bars[w],
                )

    if q_free is None:  # a program a block: its queries first
        load_queries()
    first_step, end_step = info[_FIRST_STEP], info[_END_STEP]

    def load_pages(step, cache_ref, smem, bars):  # one TMA copy a page of the step's keys, onto `bars`
        for p in range(pages_per_block):
            page = page_table_ref[req, step * pages_per_block + p]
            plgpu.copy_gmem_to_smem(cache_ref.at[kv_head, page], smem.at[pl.ds(p * page_size, page_size)], bars)

    if staging is None:

        @pl.loop(first_step, end_step)
        def _(step):
            j = done + step - first_step  # the program's steps so far: the ring's position
            slot = lax.rem(j, stages)
            for cache_ref, smem, bars, free in ((k_ref, k_smem, k_bars, k_free), (v_ref, v_smem, v_bars, v_free)):
                pl.when(j >= stages)(functools.partial(plgpu.barrier_wait, free.at[slot]))  # the stage is free
                load_pages(step, cache_ref, smem.at[slot], bars.at[slot])
            if q_free is not None:  # a persistent grid: the block's first pages go before the wait for its
                pl.when(step == first_step)(load_queries)  # queries' buffer (the last Q K^T of the block before)
        return

    # An FP8 cache: step s's pages are copied into FP8 stage s % stages, and widened `lag` steps later into
    # the 16-bit stage the consumers read (once they have freed it), so `lag` steps' copies stay in flight
    # while the producer widens. An FP8 stage is copied into again only after it was widened (program order;
    # `commit_smem` orders the widening's reads before the copy's writes).
    k_fp8, v_fp8, k_copied, v_copied = staging
    lag = stages - 1

    @pl.loop(first_step, end_step + lag)
    def _(step):
        @pl.when(step < end_step)
        def _():
            slot = lax.rem(done + step - first_step, stages)
            load_pages(step, k_ref, k_fp8.at[slot], k_copied.at[slot])
            load_pages(step, v_ref, v_fp8.at[slot], v_copied.at[slot])
            if q_free is not None:
                pl.when(step == first_step)(load_queries)

        @pl.when(step - lag >= first_step)
        def _():
            j = done + step - lag - first_step
            slot = lax.rem(j, stages)
            for fp8_smem, copied, smem, bars, free in ((k_fp8, k_copied, k_smem, k_bars, k_free),
                                                       (v_fp8, v_copied, v_smem, v_bars, v_free)):
                plgpu.barrier_wait(copied.at[slot])
                pl.when(j >= stages)(functools.partial(plgpu.barrier_wait, free.at[slot]))
                _widen(fp8_smem.at[slot], smem.at[slot])
                plgpu.commit_smem()  # the widened values visible to the consumers' wgmma
                plgpu.barrier_arrive(bars.at[slot])


def _kernel(
    info_ref, page_table_ref, q_ref, k_ref, v_ref, *refs, num_consumers, group, block_q, stages, block_kv, scores,
    p_in_registers, ping_pong, overlap, has_sinks,
):  # refs: (sinks f32[N] with `has_sinks`,) the output [T, N, H]
    sinks_ref, o_ref = refs if has_sinks else (None, *refs)
    dtype, head_dim = q_ref.dtype, q_ref.shape[-1]
    fp8 = k_ref.dtype in FP8_CACHE_DTYPES
    pages_per_block = block_kv // k_ref.shape[2]
    rows = ROWS_PER_WARPGROUP
    q_copies = [len(_pieces(w, group, block_q)) for w in range(num_consumers)]

    persistent = info_ref.ndim == 3  # i32[programs, M, _INFO]: M blocks a program; else i32[blocks, _INFO]

    def scoped(q_smem, k_smem, v_smem, p_smem, fp8_smem, o_smem, info, info_bar, q_bars, k_bars, v_bars, k_free,
               v_free, *optional):  # q_free with a persistent grid, turns with ping-pong, then the FP8 copies'
        optional = list(optional)
        staging = (*fp8_smem, *optional.pop()) if fp8 else None  # FP8 K, V; their copies' barriers
        q_free = optional[0] if persistent else None
        turns = optional[-1] if ping_pong else None
        wg = lax.axis_index("wg")
        bars = (q_bars, k_bars, v_bars, k_free, v_free, q_free)

        @pl.when(wg == num_consumers)
        def _():
            plgpu.copy_gmem_to_smem(info_ref.at[lax.axis_index("block")], info, info_bar)

        plgpu.barrier_wait(info_bar)
        pl.when(wg == num_consumers)(functools.partial(
            _producer, q_ref, k_ref, v_ref, page_table_ref, info, q_smem, k_smem, v_smem, *bars,
            num_consumers=num_consumers, group=group, block_q=block_q, stages=stages, pages_per_block=pages_per_block,
            staging=staging,
        ))
        for w in range(num_consumers):
            pl.when(wg == w)(functools.partial(
                _consumer, o_ref, sinks_ref, info, q_smem, k_smem, v_smem, p_smem, o_smem, *bars, turns, wg=w,
                group=group, block_q=block_q, stages=stages, block_kv=block_kv, scores=scores,
                p_in_registers=p_in_registers, overlap=overlap, registers=_consumer_registers(num_consumers, fp8),
            ))

    pl.run_scoped(
        scoped,
        _swizzled((num_consumers, rows, head_dim), dtype),
        _swizzled((stages, block_kv, head_dim), dtype),
        _swizzled((stages, block_kv, head_dim), dtype),
        _swizzled((num_consumers, rows, block_kv) if not p_in_registers else (1, 8, 64), dtype),  # P
        # an FP8 cache's staging buffers, K and V (none with a 16-bit cache)
        tuple(_swizzled((stages, block_kv, head_dim), ref.dtype, _FP8_SWIZZLE) for ref in (k_ref, v_ref) if fp8),
        plgpu.SMEM((num_consumers, rows, head_dim), dtype),  # the output, plain: stored a token at a time
        plgpu.SMEM(info_ref.shape[1:], jnp.int32),  # last: the swizzled buffers before it stay 1,024-byte aligned
        plgpu.Barrier(),
        tuple(plgpu.Barrier(num_arrivals=n) for n in q_copies),  # one per consumer: its query copies
        # K and V stages ready: their pages' copies arrived, or with an FP8 cache the producer widened them
        plgpu.Barrier(num_arrivals=1 if fp8 else pages_per_block, num_barriers=stages),
        plgpu.Barrier(num_arrivals=1 if fp8 else pages_per_block, num_barriers=stages),
        plgpu.Barrier(num_arrivals=num_consumers, num_barriers=stages),
        plgpu.Barrier(num_arrivals=num_consumers, num_barriers=stages),
        # one per consumer: its last Q K^T of a block done, its queries' buffer free for the next block's
        *([tuple(plgpu.Barrier() for _ in range(num_consumers))] if persistent else []),
        *([plgpu.Barrier(num_arrivals=num_consumers)] if ping_pong else []),  # the consumers' turns
        *([(plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=stages),  # the FP8 stages' copies: K, V
            plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=stages))] if fp8 else []),
        collective_axes="wg",
    )


def _describe_blocks(
    cu_q_lens: jax.Array,  # i32[R+1]
    kv_lens: jax.Array,  # i32[R]
    padded_tokens: int,
    block_q: int,
    block_kv: int,
    scores: ScoreRule,
    served: jax.Array | None,
    heavy_first: bool,
    programs: int | None = None,
) -> jax.Array:  # i32[NB, _INFO], or with `programs` i32[programs, M, _INFO]
    """Each program's description. Request r's tokens [s, e) are cut into slabs of block_q tokens from s
    rounded down to a tile, so every slab starts on one; a block's own tokens are the slab's rows inside
    [s, e), `shift` rows from its start. A slab that would pass the end of q moves back to end there.

    In the order of the requests and their slabs, or with `heavy_first` in the order of their steps, the
    most first (a stable sort: blocks of equal steps keep that order); unused blocks come last either way.

    With `programs` (a persistent grid: that many programs a KV head, each walking several blocks), program p
    takes the blocks of that order in a snake: p, 2P - 1 - p, 2P + p, ..., so the heaviest and the lightest
    pair up and the programs' steps come out nearly equal; each holds M = ceil(NB / P) rows, its used blocks
    first (the rows past NB are zeros: unused)."""
    num_reqs = kv_lens.shape[0]
    starts, ends = cu_q_lens[:-1], cu_q_lens[1:]  # i32[R]
    base = starts // _SLAB_ALIGN * _SLAB_ALIGN
    counts = jnp.where(ends > starts, pl.cdiv(ends - base, block_q), 0)
    if served is not None:
        counts = jnp.where(served, counts, 0)
    cu_counts = jnp.cumsum(counts)
    num_blocks = _num_blocks(padded_tokens, num_reqs, block_q)
    program = jnp.arange(num_blocks, dtype=jnp.int32)
    used = program < cu_counts[-1]
    req = jnp.searchsorted(cu_counts, program, side="right", method=_SEARCH)
    req = jnp.minimum(req, num_reqs - 1).astype(jnp.int32)
    slab = base[req] + (program - cu_counts[req] + counts[req]) * block_q  # unclamped start
    first_token = jnp.maximum(slab, starts[req])
    num_valid = jnp.where(used, jnp.minimum(slab + block_q, ends[req]) - first_token, 0)
    slab = jnp.minimum(slab, padded_tokens - block_q)
    shift = first_token - slab
    q_len = ends[req] - starts[req]
    kv_len = jnp.where(used, kv_lens[req], 0)
    first_pos = kv_len - q_len + first_token - starts[req]  # the block's first token's position
    # At least one step for a block of tokens: always so where each request's keys include its queries; a
    # request that breaks that gets masked zeros rather than a consumer waiting for keys never loaded.
    end_step = jnp.where(used, jnp.maximum(pl.cdiv(first_pos + num_valid, block_kv), 1), 0)
    first_step = jnp.clip(scores.first_block(first_pos, block_kv) * jnp.ones_like(end_step), 0,
                          jnp.maximum(end_step - 1, 0))
    fields = [req, slab // _SLAB_ALIGN, first_pos - shift, shift, num_valid, kv_len, first_step, end_step]
    info = jnp.stack(fields, axis=1).astype(jnp.int32)  # i32[NB, 8]
    if heavy_first:
        info = info[heaviest_first(end_step - first_step)]  # unused blocks walk 0 steps: last
    info = jnp.pad(info, ((0, 0), (0, _INFO - len(fields))))
    if programs is None:
        return info
    passes = pl.cdiv(num_blocks, programs)
    p, k = np.arange(programs)[:, None], np.arange(passes)[None, :]
    order = k * programs + np.where(k % 2 == 0, p, programs - 1 - p)  # [P, M]: the snake, static
    info = jnp.pad(info, ((0, programs * passes - num_blocks), (0, 0)))  # zero rows: unused
    return info[order]


def _num_blocks(padded_tokens: int, num_reqs: int, block_q: int) -> int:
    """The most query blocks a step has: request r has at most (q_r + 7 + block_q - 1) // block_q; summed,
    (T + 6 R) // block_q + R."""
    return (padded_tokens + (_SLAB_ALIGN - 2) * num_reqs) // block_q + num_reqs


def one_wave(num_sms: int, num_kv_heads: int) -> int:
    """A persistent grid's programs a KV head: the GPU's multiprocessors over the KV heads (one program a
    multiprocessor, its shared memory held whole), at least one."""
    return max(1, num_sms // num_kv_heads)


def block_q_for(num_q_heads: int, num_kv_heads: int, num_consumers: int) -> int:
    """Tokens per query block: a program's rows (64 per consumer warpgroup) over the padded GQA group."""
    return num_consumers * ROWS_PER_WARPGROUP // next_pow2(num_q_heads // num_kv_heads)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "sliding_window", "logit_softcap", "interpret", "num_consumers", "block_kv",
                              "stages", "p_in_registers", "ping_pong", "overlap", "heavy_first",
                              "programs_per_kv_head"),
)
def ragged_paged_attention_mgpu(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [K, num_pages, page_size, H]
    v_pages: jax.Array,  # [K, num_pages, page_size, H]
    kv_lens: jax.Array,  # i32[R]
    page_table: jax.Array,  # i32[R, P]
    cu_q_lens: jax.Array,  # i32[R+1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,  # f32[N]: attention sinks (`ops.attention.ragged_paged_attention`)
    interpret: Any = False,  # True: Mosaic GPU's interpreter; or its InterpretGPUParams
    num_consumers: int = DEFAULTS["num_consumers"],
    block_kv: int = DEFAULTS["block_kv"],
    stages: int = DEFAULTS["stages"],
    p_in_registers: bool = False,
    ping_pong: bool = False,
    overlap: bool = False,
    heavy_first: bool = True,
    programs_per_kv_head: int | None = None,
    served: jax.Array | None = None,  # bool[R]: only these requests' tokens (the others' come back as zeros)
) -> jax.Array:  # [T, N, H]
    """Same contract as `ops.attention.ragged_paged_attention` (finite values in unused page slots).

    `p_in_registers`: P V takes P from registers and accumulates in place (FlashAttention-3's way, the
    interpreter cannot run it: checked against the oracle on a Hopper GPU only) instead of through
    shared memory. `ping_pong`: the two consumers take turns on the tensor cores; `overlap`: each consumer's
    softmax runs under its own P V; `heavy_first`: the programs with the most steps start first (module
    docstring); `programs_per_kv_head`: a persistent grid of that many programs a KV head (one wave: the
    GPU's multiprocessors over the KV heads), each walking its share of the blocks (`_describe_blocks`)
    with one ring of stages, the next block's queries and pages loading under this one's last steps;
    None: a program a block.

    Jitted, so that a model's layers share one lowering of the kernel (Mosaic GPU lowers each call
    otherwise, about half a second each)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    shape = (q.dtype, k_pages.dtype, num_q_heads, num_kv_heads, head_dim, page_size)
    why = supports(*shape, num_consumers=num_consumers, block_kv=block_kv, stages=stages,
                   p_in_registers=p_in_registers, ping_pong=ping_pong, overlap=overlap,
                   persistent=programs_per_kv_head is not None)
    if why is not None:
        raise ValueError(f"the Mosaic GPU attention kernel does not take {why}")
    group = num_q_heads // num_kv_heads
    block_q = block_q_for(num_q_heads, num_kv_heads, num_consumers)
    scores = ScoreRule(sm_scale, sliding_window, logit_softcap)
    # q padded (a copy) only where its length is not a whole number of tiles or is under one slab.
    padded_tokens = max(pl.cdiv(num_tokens, _SLAB_ALIGN) * _SLAB_ALIGN, block_q)
    q_in = jnp.pad(q, ((0, padded_tokens - num_tokens), (0, 0), (0, 0))) if padded_tokens > num_tokens else q
    programs = programs_per_kv_head
    if programs is not None:  # as many more programs as a program's descriptions need to fit its shared memory
        room = HOPPER_SMEM_BYTES - shared_memory_bytes(head_dim, num_consumers, block_kv, stages, p_in_registers)
        most_blocks = (room - _BARRIER_BYTES) // (_INFO * 4)
        programs = max(programs, pl.cdiv(_num_blocks(padded_tokens, kv_lens.shape[0], block_q), most_blocks))
    info = _describe_blocks(cu_q_lens, kv_lens, padded_tokens, block_q, block_kv, scores, served, heavy_first,
                            programs)
    num_blocks = info.shape[0]  # programs along the grid's blocks axis
    if num_blocks > MAX_GRID_Y:  # past any bucket served (2,048 tokens, 256 requests: 368-480 blocks)
        raise ValueError(f"{num_blocks} query blocks: the Mosaic GPU kernel launches at most {MAX_GRID_Y}")
    pages_per_block = block_kv // page_size
    columns = pl.cdiv(page_table.shape[1], pages_per_block) * pages_per_block  # whole steps, all in range
    page_table = jnp.pad(jnp.clip(page_table, 0, num_pages - 1), ((0, 0), (0, columns - page_table.shape[1])))

    kernel = functools.partial(
        _kernel, num_consumers=num_consumers, group=group, block_q=block_q, stages=stages, block_kv=block_kv,
        scores=scores, p_in_registers=p_in_registers, ping_pong=ping_pong, overlap=overlap, has_sinks=sinks is not None,
    )
    extra = () if sinks is None else (jnp.asarray(sinks, jnp.float32),)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q_in.shape, q.dtype),
        grid=(num_blocks, num_kv_heads),  # the last axis varies fastest in launch order
        grid_names=("block", "kv_head"),
        num_threads=num_consumers + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),  # row sums stay in warps
        interpret=interpreter(interpret),
    )(info, page_table, q_in, k_pages, v_pages, *extra)[:num_tokens]
    # Tokens past the step's requests (padding), and those of requests not served, are written by no program.
    written = jnp.arange(num_tokens) < cu_q_lens[-1]
    if served is not None:
        token_req = jnp.searchsorted(cu_q_lens, jnp.arange(num_tokens), side="right", method=_SEARCH) - 1
        written &= served[jnp.minimum(token_req, served.shape[0] - 1)]
    return jnp.where(written[:, None, None], out, 0)


# Requests with fewer query tokens than this go to the Triton kernel in a Hopper step: a block of the
# Mosaic GPU kernel holds 32-128 tokens, and a decode would fill one row group of it (FlashInfer splits
# its prefill and decode kernels the same way).
MIN_Q_LEN = 16


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "logit_softcap", "interpret",
                                             "programs_per_kv_head"))
def ragged_paged_attention_hopper(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [K, num_pages, page_size, H]
    v_pages: jax.Array,  # [K, num_pages, page_size, H]
    kv_lens: jax.Array,  # i32[R]
    page_table: jax.Array,  # i32[R, P]
    cu_q_lens: jax.Array,  # i32[R+1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,  # f32[N]: attention sinks
    interpret: bool = False,  # both kernels in their interpreters (tests on a CPU)
    programs_per_kv_head: int | None = None,  # this kernel on a persistent grid
) -> jax.Array:  # [T, N, H]
    """A Hopper step with prefill tokens: requests of at least MIN_Q_LEN query tokens through this kernel,
    the rest (decodes, short chunks) through the Triton kernel; each returns zeros for the other's tokens.
    With a jax that has no Pallas Triton backend, this kernel serves them all."""
    from jaxserve.ops.paged_attention_pallas import TRITON_BACKEND, ragged_paged_attention_pallas

    scores = dict(sm_scale=sm_scale, sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks)
    long = cu_q_lens[1:] - cu_q_lens[:-1] >= MIN_Q_LEN if TRITON_BACKEND else None  # bool[R]; None: all here
    args = (q, k_pages, v_pages, kv_lens, page_table, cu_q_lens)
    shape = (q.dtype, k_pages.dtype, q.shape[1], k_pages.shape[0], q.shape[2], k_pages.shape[2])
    config = config_for(False, *shape, persistent=programs_per_kv_head is not None) or DEFAULTS  # else it says why
    mosaic = ragged_paged_attention_mgpu(*args, interpret=interpret, served=long, **scores,
                                         **{**config, "p_in_registers": config["p_in_registers"] and not interpret},
                                         programs_per_kv_head=programs_per_kv_head)
    if long is None:
        return mosaic
    triton = ragged_paged_attention_pallas(*args, interpret=bool(interpret), served=~long, **scores)
    return mosaic + triton
