"""Ragged paged attention as a Triton-backed Pallas kernel for GPUs (and in interpret mode on CPU for tests).

Two kernels share one online-softmax step over a block of KV pages:

- `_ragged_kernel` serves any step: prefill chunks, decodes, or a mix, packed over one token axis. The grid
  is (KV head, query block). A query block is up to `block_q` consecutive tokens of one request; the
  program stacks those tokens' G query heads that share its KV head into one tile of `block_q x G_pad`
  rows, so every K/V page is read once per KV head and serves the whole group (native GQA, no K/V repeat).
  Query blocks are numbered outside the kernel (a few jnp ops on i32[R]), the blocks reaching the furthest
  key first: a GPU starts programs in the order of their index (the first grid axis fastest, the KV head
  here), so the longest start first and the short ones fill in behind them, as in the Mosaic GPU kernel
  (`paged_attention_mgpu`, "Launch order").
- `_decode_kernel` serves decode-only steps (one query token per request, token r belongs to request r).
  The grid is (split, KV head, request): when batch x KV heads is too small to fill the GPU, each request's
  pages are divided among `num_splits` programs, which write partial (output, max, sum) triples that
  `_combine_splits` merges with a log-sum-exp in XLA. The requests are taken longest first (an order
  computed outside the kernel; the partials are kept in that order and put back in the requests' after
  the merge), each request's programs together.

A sliding window (Mistral, Gemma's local layers) masks keys before each query's window and starts a
program's loop at the first block its window reaches; Gemma 2's logit soft-capping bends the scores before
the softmax (`ScoreRule`).

K/V pages are gathered with index arrays, and every load is masked by the key's position, so slots past a
request's length (stale or NaN) are never read and page ids past its last page never dereferenced. Head
dims that are not a power of two are padded in registers (masked loads), never in memory.

Scores and the softmax run in float32 (exp2, with log2(e) folded into the scale); the P.V product takes
P in the model's dtype, as flash kernels do. The cache is in the model's dtype or FP8 (e4m3,
`--kv-cache-dtype fp8`): FP8 pages are loaded as bytes, half the traffic of a 16-bit cache, and widened
in registers. This module is the one place to swap in a Mosaic GPU port.

Pallas' Triton backend is deprecated (jax 0.11's Pallas changelog; jax 0.12.1 warns when it lowers). A jax
without it still imports this module: `TRITON_BACKEND` is then False, the kernels refuse to run, and
`ops.attention` serves their steps through XLA (module docstring there).
"""

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # a jax that has dropped the backend
    plgpu = None

MASK_VALUE = -1e30
LOG2_E = math.log2(math.e)
_MIN_DOT_DIM = 16  # Triton's dot needs every dimension >= 16
_SPLIT_WAVES = 2  # when splitting, aim for this many programs per streaming multiprocessor
_DEFAULT_NUM_SMS = 132  # an H100 SXM; used where no target is given (CPU, interpret mode)
# jnp.searchsorted's default ("scan") is a while loop, which XLA:GPU runs from the host, reading its
# predicate back every iteration; comparing all pairs is one small kernel (R x blocks, a few thousand).
SEARCH_METHOD = "compare_all"
# Whether this jax has Pallas' Triton backend, which the kernels here are written for (interpreted too: their
# loads, stores and dots are its primitives).
TRITON_BACKEND = plgpu is not None
# A cache of these is read as 8-bit floats and widened in registers (Triton converts them on sm_89+).
FP8_CACHE_DTYPES = (jnp.dtype(jnp.float8_e4m3fn),)


def kv_cache_shape(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """One layer's K (or V) pages: `[K, num_pages, page_size, H]`, a page's tokens contiguous per head."""
    return (num_kv_heads, num_pages, page_size, head_dim)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# The widest padded head dim the Triton kernels' default blocks fit in an H100's shared memory (Gemma 2's 256
# does). Wider heads up to 1,024 padded (DeepSeek's latent attention: 576) take smaller blocks and at most
# `MAX_WIDE_GROUP` query heads a KV head a block; at the defaults DeepSeek-V2-Lite's asked for 297 KB of the
# 227 KB (deviceless H100 compiles: docs/benchmarks.md, stop 97).
MAX_HEAD_DIM = 256
MAX_WIDE_HEAD_DIM = 1024
MAX_WIDE_GROUP = 32
WIDE_DECODE = dict(block_kv=32, num_stages=3)
WIDE_RAGGED = dict(block_kv=32, num_stages=2, block_rows=32)


def block_settings(head_dim: int, decode_only: bool) -> dict | None:
    """The kernels' block settings for a head dim: the defaults ({}), the wide heads' smaller blocks, or None
    where no setting fits (XLA's reference path serves those)."""
    padded = _padded_head_dim(head_dim)
    if padded <= MAX_HEAD_DIM:
        return {}
    if padded <= MAX_WIDE_HEAD_DIM:
        return dict(WIDE_DECODE if decode_only else WIDE_RAGGED)
    return None


def _padded_head_dim(head_dim: int) -> int:
    """The head dim the kernels compute in: a power of two that Triton's dot accepts."""
    return next_pow2(max(head_dim, _MIN_DOT_DIM))


def _head_dim_mask(padded_head_dim: int, head_dim: int) -> jax.Array:  # bool[Hp]
    """Masks the register padding of a head dim; all-true (folded away) when there is none, so the loads
    along the contiguous head dim stay vectorised."""
    if padded_head_dim == head_dim:
        return jnp.full((padded_head_dim,), True)
    return jnp.arange(padded_head_dim, dtype=jnp.int32) < head_dim


@dataclass(frozen=True)
class HeadPieces:
    """How a program holds a head's dims in registers (static: part of the kernel): in pieces of consecutive
    dims, each padded to a power of two that Triton's dot takes, the scores summed over them; and which dims of
    the values it accumulates and writes out.

    One piece is the whole head (padded: 576 dims compute as 1,024). A cache of keys alone whose values are the
    keys' first `value_dims` (DeepSeek's latent attention: the 512-dim latent, then the 64-dim RoPE key) splits
    where both parts are powers of two, as FlashMLA does: two pieces, no padding, and the first piece of each
    key block serves as its values, so the accumulator holds 512 dims where a padded head held 1,024."""

    pieces: tuple[tuple[int, int], ...]  # (first dim, width) of each piece, in order
    value_dims: int  # the output's width: the head's, or the keys' first dims that are the values

    @staticmethod
    def of(head_dim: int, value_dims: int | None = None, values_are_keys: bool = False) -> "HeadPieces":
        value_dims = head_dim if value_dims is None else value_dims
        rest = head_dim - value_dims
        if values_are_keys and rest > 0 and all(_MIN_DOT_DIM <= n == next_pow2(n) for n in (value_dims, rest)):
            return HeadPieces(((0, value_dims), (value_dims, rest)), value_dims)
        return HeadPieces(((0, head_dim),), value_dims)

    @property
    def padded(self) -> tuple[int, ...]:  # each piece's width in registers
        return tuple(_padded_head_dim(width) for _, width in self.pieces)

    def accumulated(self, values_are_keys: bool) -> int:
        """The accumulator's width: a value block's in registers (the first piece's, where the keys are the
        values)."""
        return self.padded[0] if values_are_keys else _padded_head_dim(sum(w for _, w in self.pieces))

    def load(self, ref, rows: tuple, row_mask: jax.Array) -> list[jax.Array]:
        """Each piece of `ref.at[*rows, dims]`, a list of [..., padded width]: `rows` index the leading axes
        (scalars, or arrays with a trailing axis of 1 for the dims), `row_mask` (with that axis) masks them,
        and each piece's padding is masked too."""
        loaded = []
        for (start, width), padded in zip(self.pieces, self.padded, strict=True):
            shape = (1,) * (row_mask.ndim - 1) + (padded,)
            dim = jnp.arange(padded, dtype=jnp.int32).reshape(shape)
            mask = row_mask & _head_dim_mask(padded, width).reshape(shape)
            loaded.append(plgpu.load(ref.at[(*rows, start + dim)], mask=mask, other=0.0))
        return loaded


@dataclass(frozen=True)
class ScoreRule:
    """How a program turns q.k into the softmax's scores (static: part of the kernel)."""

    sm_scale: float
    sliding_window: int | None = None  # a query sees keys down to its position - window + 1
    logit_softcap: float | None = None  # scaled scores pass through cap * tanh(s / cap) (Gemma 2)

    def log2_scores(self, dots: jax.Array) -> jax.Array:
        """The scores in the log2 domain the kernels' exp2 works in (log2(e) folded into the scale)."""
        if self.logit_softcap is None:
            return dots * (self.sm_scale * LOG2_E)
        return jnp.tanh(dots * (self.sm_scale / self.logit_softcap)) * (self.logit_softcap * LOG2_E)

    def first_block(self, first_pos: jax.Array, block_kv: int) -> jax.Array | int:
        """The first block of keys a query at `first_pos` (and any later one) can see."""
        if self.sliding_window is None:
            return 0
        return jnp.maximum(first_pos - self.sliding_window + 1, 0) // block_kv


def _attend_block(
    q: tuple[jax.Array, ...],  # each piece of the rows' queries [M, piece's padded width], the model's dtype
    k_ref,  # ref [num_pages, page_size, H] (this program's KV head), the model's dtype or FP8
    v_ref,  # the same for V, or None where the values are the keys (their first piece: loaded once for both)
    page_table_ref,  # ref i32[R, P_padded]
    req: jax.Array,  # i32 scalar
    block: jax.Array,  # i32 scalar: which block of `pages_per_block` pages
    kv_len: jax.Array,  # i32 scalar
    row_pos: jax.Array,  # i32[M]: each query row's absolute position; a row sees keys <= it
    carry: tuple[jax.Array, jax.Array, jax.Array],  # m f32[M], denom f32[M], acc f32[M, Ha]
    *,
    pages_per_block: int,
    scores: ScoreRule,
    head: HeadPieces,
):
    page_size = k_ref.shape[1]
    block_kv = pages_per_block * page_size
    page_ids = page_table_ref[req, pl.ds(block * pages_per_block, pages_per_block)]  # i32[B]
    slot = jnp.arange(page_size, dtype=jnp.int32)
    key_pos = (block * pages_per_block + jnp.arange(pages_per_block, dtype=jnp.int32))[:, None] * page_size
    key_pos = key_pos + slot[None, :]  # i32[B, page_size]
    key_live = key_pos < kv_len
    if scores.sliding_window is not None:  # keys before every row's window are never loaded
        key_live &= key_pos > jnp.min(row_pos) - scores.sliding_window
    rows = (page_ids[:, None, None], slot[None, :, None])
    # each piece of the block's keys [S, piece's padded width]; an FP8 cache widened to the queries' dtype in
    # registers
    k = [piece.reshape(block_kv, -1).astype(q[0].dtype) for piece in head.load(k_ref, rows, key_live[:, :, None])]
    if v_ref is None:  # the values are the keys: one load serves both products
        v = k[0]
    else:
        (v,) = HeadPieces.of(k_ref.shape[2]).load(v_ref, rows, key_live[:, :, None])
        v = v.reshape(block_kv, -1).astype(q[0].dtype)

    m, denom, acc = carry
    key_pos = key_pos.reshape(block_kv)
    visible = key_pos[None, :] <= row_pos[:, None]  # [M, S]
    if scores.sliding_window is not None:
        visible &= key_pos[None, :] > row_pos[:, None] - scores.sliding_window
    dots = plgpu.dot(q[0], k[0], trans_b=True)  # f32[M, S], summed over the head's pieces
    for q_piece, k_piece in zip(q[1:], k[1:], strict=True):
        dots += plgpu.dot(q_piece, k_piece, trans_b=True)
    s = jnp.where(visible, scores.log2_scores(dots), MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.where(visible, jnp.exp2(s - m_new[:, None]), 0.0)  # rows with nothing visible yet stay 0
    alpha = jnp.exp2(m - m_new)
    denom = denom * alpha + p.sum(axis=1)
    acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
    return m_new, denom, acc


def _attend_blocks(
    q: tuple[jax.Array, ...],  # each piece [M, its padded width]
    k_ref,
    v_ref,
    page_table_ref,
    req: jax.Array,
    kv_len: jax.Array,
    row_pos: jax.Array,  # i32[M]
    first_block: jax.Array | int,
    end_block: jax.Array | int,
    *,
    pages_per_block: int,
    scores: ScoreRule,
    head: HeadPieces,
    sinks: jax.Array | None = None,  # f32[M]: each row's attention-sink logit (natural log domain)
) -> tuple[jax.Array, jax.Array, jax.Array]:  # max f32[M] (log2 domain), denom f32[M], acc f32[M, Ha]
    """Runs the online softmax over blocks [first_block, end_block) of request `req`'s pages; with `sinks`,
    the running max and denominator start from each row's sink (a key that weighs no value)."""
    num_rows = q[0].shape[0]
    init = (
        jnp.full((num_rows,), MASK_VALUE, jnp.float32) if sinks is None else sinks * LOG2_E,
        jnp.zeros((num_rows,), jnp.float32) if sinks is None else jnp.ones((num_rows,), jnp.float32),
        jnp.zeros((num_rows, head.accumulated(v_ref is None)), jnp.float32),
    )
    body = functools.partial(
        _attend_block, q, k_ref, v_ref, page_table_ref, req,
        kv_len=kv_len, row_pos=row_pos, pages_per_block=pages_per_block, scores=scores, head=head,
    )
    return jax.lax.fori_loop(first_block, end_block, lambda j, carry: body(j, carry=carry), init)


def _ragged_kernel(
    block_req_ref,  # i32[NB]: the request of query block b, -1 for unused programs
    block_start_ref,  # i32[NB]: its first token, relative to the request's first
    cu_q_lens_ref,  # i32[R+1]
    kv_lens_ref,  # i32[R]
    page_table_ref,  # i32[R, P_padded]
    q_ref,  # [T, N, H]
    k_ref,  # [num_pages, page_size, H] (this program's KV head)
    *refs,  # (v_ref like k_ref unless `values_are_keys`,) (sinks f32[N] with `has_sinks`,) zeros [T, N, Hv]
    # aliased to o_ref (tokens no program writes stay zero), o_ref [T, N, Hv] (Hv: `head.value_dims`)
    group: int,
    padded_group: int,
    block_q: int,
    pages_per_block: int,
    scores: ScoreRule,
    head: HeadPieces,
    has_sinks: bool = False,
    values_are_keys: bool = False,
):
    v_ref, refs = (None, refs) if values_are_keys else (refs[0], refs[1:])
    sinks_ref = refs[0] if has_sinks else None
    o_ref = refs[-1]
    kv_head, b = pl.program_id(0), pl.program_id(1)
    req = block_req_ref[b]

    @pl.when(req >= 0)
    def _():
        num_rows = block_q * padded_group
        q_start, q_end = cu_q_lens_ref[req], cu_q_lens_ref[req + 1]
        kv_len = kv_lens_ref[req]
        first_token = q_start + block_start_ref[b]

        rows = jnp.arange(num_rows, dtype=jnp.int32)
        token = first_token + rows // padded_group  # i32[M]
        g = rows % padded_group
        row_ok = (token < q_end) & (g < group)
        rows = (token[:, None], (kv_head * group + g)[:, None])
        q = tuple(head.load(q_ref, rows, row_ok[:, None]))  # each piece [M, its padded width]
        row_pos = kv_len - q_end + token  # the request's last token sits at kv_len - 1

        last_token = jnp.minimum(first_token + block_q, q_end) - 1
        block_kv = pages_per_block * k_ref.shape[1]
        num_blocks = pl.cdiv(kv_len - q_end + last_token + 1, block_kv)
        first_block = scores.first_block(kv_len - q_end + first_token, block_kv)
        sinks = None
        if sinks_ref is not None:
            sinks = plgpu.load(sinks_ref.at[kv_head * group + jnp.minimum(g, group - 1)])  # f32[M]
        _, denom, acc = _attend_blocks(
            q, k_ref, v_ref, page_table_ref, req, kv_len, row_pos, first_block, num_blocks,
            pages_per_block=pages_per_block, scores=scores, head=head, sinks=sinks,
        )
        out = acc / jnp.where(denom == 0.0, 1.0, denom)[:, None]  # [M, Ha]: the values' dims first
        dim = jnp.arange(out.shape[1], dtype=jnp.int32)[None, :]
        mask = row_ok[:, None] & _head_dim_mask(out.shape[1], head.value_dims)[None, :]  # all-true dims: folded
        plgpu.store(o_ref.at[(*rows, dim)], out.astype(o_ref.dtype), mask=mask)


def _decode_kernel(
    order_ref,  # i32[R]: the request of each place in the launch order
    kv_lens_ref,  # i32[R]
    page_table_ref,  # i32[R, P_padded]
    q_ref,  # [R, N, H]: token r is request r's only query
    k_ref,  # [num_pages, page_size, H] (this program's KV head)
    *refs,  # (v_ref like k_ref unless `values_are_keys`,) then:
    # o_ref f32[Gr, Ha]: this split's unnormalised output (at its request's place in the order)
    # max_ref f32[Gr]: its running max (log2 domain); denom_ref f32[Gr]: its softmax denominator
    group: int,
    num_splits: int,
    pages_per_block: int,
    scores: ScoreRule,
    head: HeadPieces,
    values_are_keys: bool = False,
):
    v_ref, refs = (None, refs) if values_are_keys else (refs[0], refs[1:])
    o_ref, max_ref, denom_ref = refs
    split, kv_head, place = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    req = order_ref[place]
    num_rows = o_ref.shape[0]
    kv_len = kv_lens_ref[req]
    # Split this request's own blocks (those in its window) evenly, so short contexts still spread over
    # every split.
    block_kv = pages_per_block * k_ref.shape[1]
    num_blocks = pl.cdiv(kv_len, block_kv)
    first_block = scores.first_block(kv_len - 1, block_kv)
    per_split = pl.cdiv(num_blocks - first_block, num_splits)
    first = first_block + split * per_split
    last = jnp.minimum(first + per_split, num_blocks)

    g = jnp.arange(num_rows, dtype=jnp.int32)
    q = tuple(head.load(q_ref, (req, (kv_head * group + g)[:, None]), (g < group)[:, None]))  # pieces [Gr, .]
    row_pos = jnp.full((num_rows,), kv_len - 1, jnp.int32)
    m, denom, acc = _attend_blocks(
        q, k_ref, v_ref, page_table_ref, req, kv_len, row_pos, first, last,
        pages_per_block=pages_per_block, scores=scores, head=head,
    )
    o_ref[...] = acc
    max_ref[...] = m
    denom_ref[...] = denom


def _pages_per_block(page_size: int, block_kv: int, max_pages: int) -> int:
    if block_kv % page_size or block_kv & (block_kv - 1):
        raise ValueError(f"block_kv={block_kv} must be a power of two and a multiple of page_size={page_size}")
    return min(block_kv // page_size, next_pow2(max_pages))


def _pad_page_table(page_table: jax.Array, pages_per_block: int) -> jax.Array:
    """Pads columns to a whole number of blocks, so a block's page ids are always one in-range slice."""
    max_pages = page_table.shape[1]
    return jnp.pad(page_table, ((0, 0), (0, -max_pages % pages_per_block)))


def _compiler_params(num_warps: int, num_stages: int):  # -> plgpu.CompilerParams
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def missing_backend() -> str | None:
    """Why the kernels cannot run with this jax, or None where they can."""
    if TRITON_BACKEND:
        return None
    return f"jax {jax.__version__} has no Pallas Triton backend (deprecated since jax 0.11), which these kernels need"


def _require_backend() -> None:
    if (reason := missing_backend()) is not None:
        raise RuntimeError(reason)


def _check_shapes(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array | None, value_dims: int | None = None) -> None:
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_pages.shape[0]
    if value_dims is not None and (v_pages is not None or not 0 < value_dims <= head_dim):
        raise ValueError(f"value_dims={value_dims}: the values are the keys' first dims (v_pages None), 1..{head_dim}")
    if v_pages is not None and k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if k_pages.shape[3] != head_dim:
        raise ValueError(f"head dim of q ({head_dim}) and of the pages ({k_pages.shape[3]}) differ")
    if k_pages.dtype != q.dtype and k_pages.dtype not in FP8_CACHE_DTYPES:
        raise ValueError(f"q is {q.dtype} but the KV pages are {k_pages.dtype} (the model's dtype or FP8)")


def heaviest_first(work: jax.Array, used: jax.Array | None = None) -> jax.Array:  # i32[n]
    """The launch order of programs of `work` (i32[n], any unit): the most first, a stable sort (equal work
    keeps the given order), and the ones not `used` last. Each kernel here and `paged_attention_mgpu` take
    their programs in this order (module docstrings)."""
    key = -work if used is None else jnp.where(used, -work, jnp.iinfo(jnp.int32).max)
    return jnp.argsort(key, stable=True).astype(jnp.int32)


def query_blocks(
    cu_q_lens: jax.Array,  # i32[R+1]
    kv_lens: jax.Array,  # i32[R]
    num_tokens: int,
    block_q: int,
    served: jax.Array | None = None,
    heavy_first: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Numbers the query blocks: block b belongs to request block_req[b] (-1: unused) and starts at its
    token block_start[b]. At most T / block_q + R blocks exist (a static count); the unused ones come last.
    Request by request, or with `heavy_first` by the key their last token reaches, furthest first (a
    stable sort: its keys are the block's work without a sliding window). `served` (bool[R]): only those
    requests get blocks."""
    num_reqs = cu_q_lens.shape[0] - 1
    num_blocks = pl.cdiv(num_tokens, block_q) + num_reqs
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # i32[R]
    if served is not None:
        q_lens = jnp.where(served, q_lens, 0)
    cu_blocks = jnp.cumsum(pl.cdiv(q_lens, block_q))  # i32[R]
    program = jnp.arange(num_blocks, dtype=jnp.int32)
    block_req = jnp.searchsorted(cu_blocks, program, side="right", method=SEARCH_METHOD).astype(jnp.int32)
    is_used = program < cu_blocks[-1]
    block_req = jnp.minimum(block_req, num_reqs - 1)
    first_block = cu_blocks[block_req] - pl.cdiv(q_lens[block_req], block_q)
    block_start = jnp.where(is_used, (program - first_block) * block_q, 0)  # i32[NB]
    block_req = jnp.where(is_used, block_req, -1)  # i32[NB]
    if heavy_first:
        q_len = q_lens[jnp.maximum(block_req, 0)]
        reach = kv_lens[jnp.maximum(block_req, 0)] - q_len + jnp.minimum(block_start + block_q, q_len)
        order = heaviest_first(reach, is_used)
        block_req, block_start = block_req[order], block_start[order]
    return block_req, block_start  # i32[NB], i32[NB]


def ragged_paged_attention_pallas(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [K, num_pages, page_size, H]
    v_pages: jax.Array | None,  # [K, num_pages, page_size, H]; None: the values are the keys
    kv_lens: jax.Array,  # i32[R]
    page_table: jax.Array,  # i32[R, P]
    cu_q_lens: jax.Array,  # i32[R+1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,  # f32[N]: attention sinks (`ops.attention.ragged_paged_attention`)
    interpret: bool = False,
    block_rows: int = 64,
    block_kv: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    served: jax.Array | None = None,  # bool[R]: only these requests' tokens (the others' come back as zeros)
    heavy_first: bool = True,  # the blocks reaching the furthest key start first (module docstring)
    value_dims: int | None = None,  # with v_pages None: the values are the keys' first `value_dims` dims
) -> jax.Array:  # [T, N, Hv]: Hv is value_dims, or H
    """The general kernel: same contract as `ops.attention.ragged_paged_attention`."""
    _require_backend()
    _check_shapes(q, k_pages, v_pages, value_dims)
    num_tokens, num_q_heads, _ = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    padded_group = next_pow2(group)
    block_q = max(1, block_rows // padded_group)
    if block_q * padded_group < _MIN_DOT_DIM:
        block_q = _MIN_DOT_DIM // padded_group
    pages_per_block = _pages_per_block(page_size, block_kv, page_table.shape[1])
    page_table = _pad_page_table(page_table, pages_per_block)

    block_req, block_start = query_blocks(cu_q_lens, kv_lens, num_tokens, block_q, served, heavy_first)
    num_programs = block_req.shape[0]
    head = HeadPieces.of(q.shape[2], value_dims, v_pages is None)
    out_shape = jax.ShapeDtypeStruct((num_tokens, num_q_heads, head.value_dims), q.dtype)
    kernel = functools.partial(
        _ragged_kernel, group=group, padded_group=padded_group, block_q=block_q,
        pages_per_block=pages_per_block, scores=ScoreRule(sm_scale, sliding_window, logit_softcap),
        head=head, has_sinks=sinks is not None, values_are_keys=v_pages is None,
    )
    whole = pl.BlockSpec()  # the kernel indexes these itself
    per_kv_head = pl.BlockSpec((None, *k_pages.shape[1:]), lambda h, b: (h, 0, 0, 0))
    pages = (k_pages,) if v_pages is None else (k_pages, v_pages)
    extra = () if sinks is None else (jnp.asarray(sinks, jnp.float32),)
    zeros_index = 6 + len(pages) + len(extra)
    return pl.pallas_call(
        kernel,
        grid=(num_kv_heads, num_programs),  # the first axis varies fastest in launch order
        in_specs=[whole, whole, whole, whole, whole, whole, *(per_kv_head for _ in pages), *(whole for _ in extra),
                  whole],
        out_specs=whole,
        out_shape=out_shape,
        input_output_aliases={zeros_index: 0},
        compiler_params=_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(block_req, block_start, cu_q_lens, kv_lens, page_table, q, *pages, *extra,
      jnp.zeros(out_shape.shape, out_shape.dtype))


def default_num_splits(
    num_reqs: int, num_kv_heads: int, max_pages: int, pages_per_block: int, num_sms: int = _DEFAULT_NUM_SMS
) -> int:
    """1 when requests x KV heads already fill most SMs; otherwise enough splits for about two programs
    per SM, and never more than a request's largest number of page blocks."""
    num_programs = num_reqs * num_kv_heads
    if num_programs >= 0.8 * num_sms:
        return 1
    wanted = pl.cdiv(_SPLIT_WAVES * num_sms, num_programs)
    return max(1, min(wanted, pl.cdiv(max_pages, pages_per_block)))


def paged_decode_attention_pallas(
    q: jax.Array,  # [R, N, H]: one query token per request
    k_pages: jax.Array,  # [K, num_pages, page_size, H]
    v_pages: jax.Array | None,  # [K, num_pages, page_size, H]; None: the values are the keys
    kv_lens: jax.Array,  # i32[R]; 0 for padding requests
    page_table: jax.Array,  # i32[R, P]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,  # f32[N]: attention sinks, joined to the splits when they are merged
    interpret: bool = False,
    block_kv: int = 64,  # 64 keys x 3 stages: the best of an H100 sweep (docs/benchmarks.md)
    num_splits: int | None = None,
    num_sms: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    heavy_first: bool = True,
    value_dims: int | None = None,  # with v_pages None: the values are the keys' first `value_dims` dims
) -> jax.Array:  # [R, N, Hv]: Hv is value_dims, or H
    """The decode specialisation (split-KV). Request r's query is token r at position kv_lens[r] - 1.

    `num_splits` defaults to about two waves of programs over the `num_sms` SMs of the target;
    `heavy_first` launches the longest requests' programs first (else in the requests' order)."""
    _require_backend()
    _check_shapes(q, k_pages, v_pages, value_dims)
    num_reqs, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    if page_table.shape[0] != num_reqs:
        raise ValueError(f"decode needs one token per request: {num_reqs} tokens, {page_table.shape[0]} requests")
    group = num_q_heads // num_kv_heads
    num_rows = max(_MIN_DOT_DIM, next_pow2(group))
    head = HeadPieces.of(head_dim, value_dims, v_pages is None)
    accumulated = head.accumulated(v_pages is None)
    pages_per_block = _pages_per_block(page_size, block_kv, page_table.shape[1])
    if num_splits is None:
        num_splits = default_num_splits(
            num_reqs, num_kv_heads, page_table.shape[1], pages_per_block, num_sms or _DEFAULT_NUM_SMS
        )
    page_table = _pad_page_table(page_table, pages_per_block)

    kernel = functools.partial(
        _decode_kernel, group=group, num_splits=num_splits, pages_per_block=pages_per_block,
        scores=ScoreRule(sm_scale, sliding_window, logit_softcap), head=head, values_are_keys=v_pages is None,
    )
    order = decode_order(kv_lens, heavy_first)  # i32[R]
    whole = pl.BlockSpec()
    per_kv_head = pl.BlockSpec((None, *k_pages.shape[1:]), lambda s, h, r: (h, 0, 0, 0))
    pages = (k_pages,) if v_pages is None else (k_pages, v_pages)
    partial_shape = (num_splits, num_reqs, num_kv_heads, num_rows)
    out, m, denom = pl.pallas_call(
        kernel,
        grid=(num_splits, num_kv_heads, num_reqs),  # the first axis varies fastest in launch order
        in_specs=[whole, whole, whole, whole, *(per_kv_head for _ in pages)],
        out_specs=[
            pl.BlockSpec((None, None, None, num_rows, accumulated), lambda s, h, r: (s, r, h, 0, 0)),
            pl.BlockSpec((None, None, None, num_rows), lambda s, h, r: (s, r, h, 0)),
            pl.BlockSpec((None, None, None, num_rows), lambda s, h, r: (s, r, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*partial_shape, accumulated), jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
        ],
        compiler_params=_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="paged_decode_attention",
    )(order, kv_lens, page_table, q, *pages)
    if sinks is not None:  # one more partial softmax per row: its sink's logit, a denominator of 1, no values
        row_sinks = jnp.asarray(sinks, jnp.float32).reshape(num_kv_heads, group) * LOG2_E
        row_sinks = jnp.pad(row_sinks, ((0, 0), (0, num_rows - group)))  # f32[K, Gr]
        sink_max = jnp.broadcast_to(row_sinks, (1, num_reqs, num_kv_heads, num_rows))
        m = jnp.concatenate([m, sink_max])
        denom = jnp.concatenate([denom, jnp.ones_like(sink_max)])
        out = jnp.concatenate([out, jnp.zeros((1, *out.shape[1:]), out.dtype)])
    out = _combine_splits(out, m, denom)[:, :, :group, :head.value_dims]  # f32[R, K, G, Hv], launch order
    if heavy_first:  # back in the requests' order: request r's output is at its place in the launch order
        place = jnp.zeros_like(order).at[order].set(jnp.arange(num_reqs, dtype=jnp.int32))  # i32[R]
        out = out[place]
    return out.reshape(num_reqs, num_q_heads, head.value_dims).astype(q.dtype)


def decode_order(kv_lens: jax.Array, heavy_first: bool = True) -> jax.Array:  # i32[R]
    """The request at each place of the decode kernel's launch order: the longest first (a stable sort:
    equal lengths keep the requests' order, padding requests of no keys come last), or the requests' own."""
    return heaviest_first(kv_lens) if heavy_first else jnp.arange(kv_lens.shape[0], dtype=jnp.int32)


def _combine_splits(
    out: jax.Array,  # f32[S, R, K, Gr, Hp]
    m: jax.Array,  # f32[S, R, K, Gr]
    denom: jax.Array,  # f32[S, R, K, Gr]
) -> jax.Array:  # f32[R, K, Gr, Hp]
    """Merges the splits' partial softmaxes; rows that saw no key (empty context) come out as zeros.

    One reduction over the splits whose combiner merges two partial softmaxes (the running max, the
    rescaled sums), so XLA emits one kernel; the max over splits first and the weighted sums after took
    two (a kernel a layer of every decode step). Empty splits carry m = MASK_VALUE, denom = 0 and acc = 0,
    so they add nothing; MASK_VALUE is also the identity's max (an infinite one would merge to NaN)."""

    def merge(a: tuple, b: tuple) -> tuple:
        (m_a, denom_a, acc_a), (m_b, denom_b, acc_b) = a, b
        m_ab = jnp.maximum(m_a, m_b)
        w_a, w_b = jnp.exp2(m_a - m_ab), jnp.exp2(m_b - m_ab)
        return m_ab, denom_a * w_a + denom_b * w_b, acc_a * w_a + acc_b * w_b

    def spread(x: jax.Array) -> jax.Array:  # [S, R, K, Gr] -> [S, R, K, Gr, Hp]: a reduction's operands share a shape
        return jnp.broadcast_to(x[..., None], out.shape)

    identity = (jnp.float32(MASK_VALUE), jnp.float32(0.0), jnp.float32(0.0))
    _, denom, total = jax.lax.reduce((spread(m), spread(denom), out), identity, merge, (0,))
    return total / jnp.where(denom == 0.0, 1.0, denom)
