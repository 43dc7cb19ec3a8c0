"""Sampling inside the jitted step, with per-row parameters.

Order: the structured-output grammar's token bitmask, then logit_bias and min_tokens bans, then
penalties, then greedy or temperature, top-k, top-p, min-p. Reported logprobs (and the top-L
alternatives) are the raw model's, as in vLLM. If the bans leave a row no token at all (min_tokens
banning the only tokens its grammar allows), the row falls back to its grammar alone.

Each optional stage sits behind a `lax.cond` on "does any row use it", so a plain greedy batch costs
an argmax. Each row draws from its own key, fold_in(key(seed), output_index): the same seed gives the
same tokens whatever shares the batch.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.runner.batch import SamplingArrays
from jaxserve.runner.penalties import PenaltyTables, apply_penalties


def _filter_logits(
    logits: jax.Array,  # f32[R, V], already divided by temperature
    top_k: jax.Array,  # i32[R]
    top_p: jax.Array,  # f32[R]
    min_p: jax.Array,  # f32[R]
) -> jax.Array:  # f32[R, V] with filtered-out tokens at -inf
    """Top-k, then top-p over what top-k kept (renormalised), then min-p against the top token."""
    vocab_size = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)  # [R, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab_size), vocab_size)  # [R]
    rank = jnp.arange(vocab_size)[None, :]
    sorted_desc = jnp.where(rank < k[:, None], sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # [R, V]
    # Bound by k explicitly: rounding can leave the cumulative mass just under top_p = 1.
    kept = (mass_before < top_p[:, None]) & (rank < k[:, None])
    num_kept = jnp.maximum(jnp.sum(kept, axis=-1), 1)  # [R]
    cutoff = jnp.take_along_axis(sorted_desc, (num_kept - 1)[:, None], axis=-1)  # [R, 1]
    min_p_cutoff = sorted_desc[:, :1] + jnp.log(jnp.maximum(min_p, 1e-30))[:, None]  # log(p_max * min_p)
    cutoff = jnp.maximum(cutoff, jnp.where(min_p[:, None] > 0, min_p_cutoff, -jnp.inf))
    return jnp.where(logits >= cutoff, logits, -jnp.inf)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    tokens: jax.Array  # i32[R]
    logprobs: jax.Array  # f32[R]: the sampled token's logprob under the raw model
    top_token_ids: jax.Array  # i32[R, L]: the L most likely tokens (zeros unless a row asked)
    top_logprobs: jax.Array  # f32[R, L]


def apply_token_bitmask(
    logits: jax.Array,  # f32[R, V]
    bitmask: jax.Array,  # i32[R, W], W = ceil(V / 32)
    constrained: jax.Array,  # bool[R]
) -> jax.Array:  # f32[R, V]: tokens a constrained row's mask lacks at -inf
    num_rows, vocab_size = logits.shape
    bits = jnp.right_shift(bitmask[:, :, None].view(jnp.uint32), jnp.arange(32, dtype=jnp.uint32)) & 1  # [R, W, 32]
    allowed = bits.reshape(num_rows, -1)[:, :vocab_size].astype(jnp.bool_)  # [R, V]
    return jnp.where(constrained[:, None] & ~allowed, -jnp.inf, logits)


def _process_logits(logits: jax.Array, params: SamplingArrays, tables: PenaltyTables) -> jax.Array:
    """The grammar mask, then logit_bias (and min_tokens' bans), then penalties; each skipped when no row
    uses it."""
    logits = jax.lax.cond(
        jnp.any(params.constrained),
        lambda x: apply_token_bitmask(x, params.token_bitmask, params.constrained),
        lambda x: x,
        logits,
    )
    vocab_size, num_slots = logits.shape[-1], tables.output_counts.shape[0]

    def process(masked: jax.Array) -> jax.Array:
        rows = jnp.broadcast_to(jnp.arange(masked.shape[0])[:, None], params.bias_token_ids.shape)
        biased = masked.at[rows, params.bias_token_ids].add(params.bias_values, mode="drop")
        processed = apply_penalties(
            biased, tables, params.penalty_slots,
            params.repetition_penalty, params.frequency_penalty, params.presence_penalty,
        )
        no_token_left = jnp.all(processed == -jnp.inf, axis=-1, keepdims=True)  # [R, 1]
        return jnp.where(no_token_left, masked, processed)

    needed = jnp.any(params.bias_token_ids < vocab_size) | jnp.any(params.penalty_slots < num_slots)
    return jax.lax.cond(needed, process, lambda x: x, logits)


def sample(
    logits: jax.Array,  # f32[R, V]
    params: SamplingArrays,
    tables: PenaltyTables,
    num_top_logprobs: int,
) -> SamplerOutput:
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)  # what logprobs report, as in vLLM
    logits = _process_logits(logits, params, tables)
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    is_greedy = params.temperature <= 0.0

    def random_tokens(logits: jax.Array) -> jax.Array:
        temperature = jnp.where(is_greedy, 1.0, params.temperature)
        scaled = logits / temperature[:, None]
        needs_filter = jnp.any((params.top_k > 0) | (params.top_p < 1.0) | (params.min_p > 0.0))
        scaled = jax.lax.cond(
            needs_filter,
            lambda x: _filter_logits(x, params.top_k, params.top_p, params.min_p),
            lambda x: x,
            scaled,
        )
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(
            params.seeds, params.output_index
        )
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], jnp.float32))(keys)
        sampled = jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)
        return jnp.where(is_greedy, greedy_tokens, sampled)

    tokens = jax.lax.cond(jnp.all(is_greedy), lambda x: greedy_tokens, random_tokens, logits)
    token_logprobs = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]

    num_rows = logits.shape[0]
    no_top = (jnp.zeros((num_rows, num_top_logprobs), jnp.float32),
              jnp.zeros((num_rows, num_top_logprobs), jnp.int32))
    top_logprobs, top_ids = jax.lax.cond(
        jnp.any(params.wants_top_logprobs),
        lambda x: tuple(jax.lax.top_k(x, num_top_logprobs)),
        lambda x: no_top,
        raw_logprobs,
    )
    return SamplerOutput(tokens, token_logprobs, top_ids.astype(jnp.int32), top_logprobs)
