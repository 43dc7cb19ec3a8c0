"""Vocabulary-wide selections without sorting: argmax, top-k/top-p thresholds, a categorical draw, and the
top-k values themselves (`top_k`, on the backend's own top-k).

The sampler's work per row is a pass or a few over V logits (49,152 for SmolLM2, 128,256 for Llama 3).
The obvious jnp forms are slow on XLA:CPU, measured at 64 rows x 49,152 (benchmarks/sampler.py):
`jnp.sort` (what top-k/top-p needed) ~840 ms, `jnp.argmax` (a variadic value/index reduce) ~7 ms, Gumbel
noise from one threefry key per row ~90 ms. Each is replaced by plain reductions, which every backend
runs at memory speed:

- `first_argmax`: the maximum of each 128-token chunk, the first chunk holding the row's maximum, the
  first index of it inside that chunk. Same answer as `jnp.argmax` (first index on ties, NaN wins).
- `top_k_threshold`, `top_p_threshold`: top-k and top-p as a threshold on the probabilities, found by
  bisecting the float's bit pattern (non-negative float32s order like their uint32 bits), one masked
  count or sum per step. The kept set is the sort-based one: every token at or above the k-th largest
  probability, then those whose probability mass strictly above them is under top_p of what top-k kept
  (ties kept together).
- `top_k`: `jax.lax.top_k`, on CUDA GPUs in pieces of at most 16 (XLA:GPU's own TopK kernel); a larger k
  there becomes a sort of each whole row, many kernels to compile and a slower step.
- `rank_of`: a value's rank in its row (1 = the largest), one masked count: the rank vLLM reports with a
  sampled or prompt token's logprob.
- `sample_categorical`: inverse-CDF sampling with one uniform per row: the row's mass per chunk, the
  chunk where the cumulative mass crosses u x total, then the token inside it. Tokens of zero
  probability are never drawn (each level also requires weight, as XLA:CPU's blocked cumsum rounds).
"""

import jax
import jax.numpy as jnp

CHUNK = 128  # tokens per chunk of the two-level reductions (the fastest of 128/512/2048 measured)
_BISECTION_STEPS = 32  # enough to pin any float32 bit pattern


def _chunks(x: jax.Array, fill: float) -> jax.Array:  # [R, V] -> [R, C, CHUNK], padded with `fill`
    pad = -x.shape[-1] % CHUNK
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill)
    return x.reshape(x.shape[0], -1, CHUNK)


def first_argmax(x: jax.Array) -> jax.Array:  # f32[R, V] -> i32[R]
    """`jnp.argmax(x, axis=-1)` as two plain reductions."""
    chunks = _chunks(x, -jnp.inf)  # [R, C, CHUNK]
    chunk = jnp.argmax(chunks.max(axis=-1), axis=-1)  # [R]: argmax over C values is cheap
    inner = jnp.take_along_axis(chunks, chunk[:, None, None], axis=1)[:, 0]  # [R, CHUNK]
    return (chunk * CHUNK + jnp.argmax(inner, axis=-1)).astype(jnp.int32)


def _bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _float(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _bisect(lo: jax.Array, hi: jax.Array, is_high) -> jax.Array:
    """The least uint32 t in (lo, hi] with is_high(t), given is_high monotone, not at lo and true at hi."""

    def body(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2  # u32[R]; equals lo once hi = lo + 1
        high = is_high(mid) & (mid > lo)
        return jnp.where(high, lo, mid), jnp.where(high, mid, hi)

    return jax.lax.fori_loop(0, _BISECTION_STEPS, body, (lo, hi))[1]


def top_k_threshold(probs: jax.Array, top_k: jax.Array) -> jax.Array:  # f32[R, V], i32[R] -> f32[R]
    """The k-th largest probability of each row (0 where top_k is 0, keeping everything)."""
    k = jnp.clip(top_k, 1, probs.shape[-1])  # [R]

    def too_high(bits: jax.Array) -> jax.Array:  # fewer than k tokens at or above the candidate
        return jnp.sum(probs >= _float(bits)[:, None], axis=-1) < k

    one = _bits(jnp.ones(probs.shape[0], jnp.float32))
    lowest_too_high = _bisect(jnp.zeros_like(one), one + 1, too_high)  # count(p >= 0) = V >= k: not too high
    threshold = _float(lowest_too_high - 1)
    # XLA:CPU flushes subnormals to zero, so a k-th largest of 0 comes out as a subnormal bit pattern.
    return jnp.where((top_k > 0) & (threshold >= jnp.finfo(jnp.float32).tiny), threshold, 0.0)


def top_p_threshold(probs: jax.Array, top_p: jax.Array, floor: jax.Array) -> jax.Array:
    """The least probability kept by top-p over the tokens at or above `floor` (f32[R]); 0 where top_p = 1.

    A token is kept when the mass strictly above it, over the tokens `floor` keeps, is under top_p of their
    total: the sorted cumulative rule, ties kept together."""
    eligible = jnp.where(probs >= floor[:, None], probs, 0.0)  # [R, V]
    budget = top_p * eligible.sum(axis=-1)  # [R]

    def keeps_at(bits: jax.Array) -> jax.Array:  # the mass above the candidate is under the budget
        return jnp.sum(jnp.where(eligible > _float(bits)[:, None], eligible, 0.0), axis=-1) < budget

    # The row's largest probability always qualifies (nothing is above it); the answer lies in [0, max].
    top = _bits(eligible.max(axis=-1))
    least = _bisect(jnp.zeros_like(top), top, keeps_at)  # at 0 the whole mass is above: never kept
    return jnp.where(top_p < 1.0, _float(least), 0.0)


_GPU_TOP_K_KERNEL_MAX = 16  # the largest k XLA:GPU runs as its TopK kernel rather than as a sort


def top_k(x: jax.Array, k: int, on_cuda: bool) -> tuple[jax.Array, jax.Array]:  # f32[R, V] -> f32[R, k], i32[R, k]
    """`jax.lax.top_k(x, k)`: the k largest of each row, largest first, and their indices. On CUDA GPUs k
    above 16 is taken 16 at a time, each piece's tokens set to -inf before the next (a row then needs k
    entries above -inf, as logits and logprobs have): one pass over the row per piece."""
    if not on_cuda or k <= _GPU_TOP_K_KERNEL_MAX:
        return tuple(jax.lax.top_k(x, k))
    rows = jnp.arange(x.shape[0])[:, None]  # [R, 1]
    values, indices = [], []
    while k:
        piece = min(k, _GPU_TOP_K_KERNEL_MAX)
        top, index = jax.lax.top_k(x, piece)  # [R, piece]
        values.append(top)
        indices.append(index)
        k -= piece
        if k:
            x = x.at[rows, index].set(-jnp.inf)
    return jnp.concatenate(values, axis=-1), jnp.concatenate(indices, axis=-1)


def rank_of(x: jax.Array, value: jax.Array) -> jax.Array:  # f32[R, V], f32[R] -> i32[R]
    """1 + the number of entries of each row above its `value`: 1 for the row's largest."""
    return jnp.sum(x > value[:, None], axis=-1, dtype=jnp.int32) + 1


def sample_categorical(weights: jax.Array, uniforms: jax.Array) -> jax.Array:
    """One draw per row from unnormalised non-negative `weights` f32[R, V] (a positive entry per row),
    with `uniforms` f32[R] in [0, 1): the token where the cumulative weight first exceeds u x total."""
    chunks = _chunks(weights, 0.0)  # [R, C, CHUNK]
    chunk_mass = chunks.sum(axis=-1)  # [R, C]
    cumulative = jnp.cumsum(chunk_mass, axis=-1)  # [R, C]
    target = uniforms * cumulative[:, -1]  # [R]
    chunk = _first_crossing(cumulative, chunk_mass, target)  # [R]
    before = jnp.where(chunk > 0, jnp.take_along_axis(cumulative, (chunk - 1)[:, None], axis=1)[:, 0], 0.0)
    inner = jnp.take_along_axis(chunks, chunk[:, None, None], axis=1)[:, 0]  # [R, CHUNK]
    index = _first_crossing(before[:, None] + jnp.cumsum(inner, axis=-1), inner, target)
    return (chunk * CHUNK + index).astype(jnp.int32)


def _first_crossing(cumulative: jax.Array, weights: jax.Array, target: jax.Array) -> jax.Array:
    """The first index whose cumulative weight exceeds `target` and whose own weight is positive, else the
    last positive one: f32[R, N], f32[R, N], f32[R] -> i32[R].

    The weight test is what keeps zero-weight tokens out: XLA:CPU's cumsum adds in blocks, so its prefix
    sums need not be monotone nor stay flat over zeros, and a target can fall in such a rounding step."""
    positions = jnp.arange(weights.shape[-1], dtype=jnp.int32)
    crossing = (cumulative > target[:, None]) & (weights > 0)
    return jnp.min(jnp.where(crossing, positions, _last_positive(weights)[:, None]), axis=-1)


def _last_positive(x: jax.Array) -> jax.Array:  # f32[R, N] -> i32[R]: the last index with x > 0 (0 if none)
    n = x.shape[-1]
    return jnp.max(jnp.where(x > 0, jnp.arange(n, dtype=jnp.int32), 0), axis=-1)
