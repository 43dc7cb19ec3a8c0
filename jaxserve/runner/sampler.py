"""Sampling inside the jitted step, with per-row parameters.

Order: the structured-output grammar's token bitmask, then logit_bias and min_tokens bans, then
penalties, then greedy or temperature, top-k, top-p, min-p. Reported logprobs (and the top-L
alternatives) are the raw model's, as in vLLM. If the bans leave a row no token at all (min_tokens
banning the only tokens its grammar allows), the row falls back to its grammar alone.

Each optional stage sits behind a `lax.cond` on "does any row use it", so a plain greedy batch costs
an argmax, and logprobs cost nothing unless a row asks. On CUDA GPUs the logit processing (grammar mask,
bias and penalties) runs as one stage with no conditionals nested inside (`on_cuda`): XLA:GPU copies the
[R, V] logits through a conditional's pass-through branch and reads each predicate on the host; and the
top logprobs are taken as XLA:GPU's TopK kernel takes them (`selection.top_k`).
Nothing sorts the vocabulary: top-k and top-p are thresholds on the probabilities and a draw is an
inverse-CDF lookup (`selection`). Each row draws one uniform from its own key, fold_in(key(seed),
output_index): the same seed gives the same tokens whatever shares the batch.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.runner.penalties import PenaltyTables, apply_penalties
from jaxserve.runner.selection import (
    first_argmax,
    rank_of,
    sample_categorical,
    top_k,
    top_k_threshold,
    top_p_threshold,
)
from jaxserve.runner.step_batch import SamplingArrays
from jaxserve.sampling_params import GREEDY_TEMPERATURE


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    tokens: jax.Array  # i32[R]
    logprobs: jax.Array  # f32[R]: the sampled token's logprob under the raw model (zeros unless a row asked)
    ranks: jax.Array  # i32[R]: its rank there, 1 = the most likely (zeros unless a row asked)
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


def _uses_bias_or_penalties(params: SamplingArrays, tables: PenaltyTables) -> jax.Array:  # bool[]
    num_slots, vocab_size = tables.output_counts.shape
    return jnp.any(params.bias_token_ids < vocab_size) | jnp.any(params.penalty_slots < num_slots)


def _modifies_logits(params: SamplingArrays, tables: PenaltyTables) -> jax.Array:  # bool[]
    """Whether any row has a grammar, a logit bias or ban, or penalties."""
    return jnp.any(params.constrained) | _uses_bias_or_penalties(params, tables)


def _process_logits(logits: jax.Array, params: SamplingArrays, tables: PenaltyTables, skip_unused: bool) -> jax.Array:
    """The grammar mask, then logit_bias (and min_tokens' bans), then penalties. `skip_unused`: each of the
    two behind its own `lax.cond` on whether a row uses it (CPUs: XLA:CPU copies nothing through the
    pass-through branch, and a grammar-only batch skips the penalties' pass over the logits); else both
    for every row (CUDA GPUs), where a row without a grammar, bias or penalty passes through unchanged."""

    def mask(x: jax.Array) -> jax.Array:
        return apply_token_bitmask(x, params.token_bitmask, params.constrained)

    def bias_and_penalize(masked: jax.Array) -> jax.Array:
        rows = jnp.broadcast_to(jnp.arange(masked.shape[0])[:, None], params.bias_token_ids.shape)
        biased = masked.at[rows, params.bias_token_ids].add(params.bias_values, mode="drop")
        processed = apply_penalties(
            biased, tables, params.penalty_slots, params.penalty_drafts,
            params.repetition_penalty, params.frequency_penalty, params.presence_penalty, fused=not skip_unused,
        )
        no_token_left = jnp.all(processed == -jnp.inf, axis=-1, keepdims=True)  # [R, 1]
        return jnp.where(no_token_left, masked, processed)

    if not skip_unused:
        return bias_and_penalize(mask(logits))
    masked = jax.lax.cond(jnp.any(params.constrained), mask, lambda x: x, logits)
    return jax.lax.cond(_uses_bias_or_penalties(params, tables), bias_and_penalize, lambda x: x, masked)


def _keep_floor(probs: jax.Array, params: SamplingArrays) -> jax.Array:  # f32[R, V] (max 1 per row) -> f32[R]
    """The least probability a row keeps: top-k, then top-p over what top-k kept (renormalised), and
    min-p against the top token (whose probability here is 1)."""
    no_floor = jnp.zeros(probs.shape[0], jnp.float32)
    floor_k = jax.lax.cond(jnp.any(params.top_k > 0), lambda: top_k_threshold(probs, params.top_k), lambda: no_floor)
    floor_p = jax.lax.cond(
        jnp.any(params.top_p < 1.0), lambda: top_p_threshold(probs, params.top_p, floor_k), lambda: no_floor
    )
    return jnp.maximum(jnp.maximum(floor_k, floor_p), params.min_p)


def no_logprobs(num_rows: int, num_top: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """What is reported when no row asks: token logprobs f32[R], their ranks i32[R], top logprobs f32[R, L],
    top ids i32[R, L]."""
    return (jnp.zeros(num_rows, jnp.float32), jnp.zeros(num_rows, jnp.int32),
            jnp.zeros((num_rows, num_top), jnp.float32), jnp.zeros((num_rows, num_top), jnp.int32))


def _reported_logprobs(
    raw_logits: jax.Array, tokens: jax.Array, params: SamplingArrays, num_top_logprobs: int, on_cuda: bool
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The sampled tokens' logprobs f32[R] and ranks i32[R], and the top-L alternatives (f32[R, L],
    i32[R, L]) under the raw model, as in vLLM; zeros unless a row asked (a [R, V] log-softmax costs as
    much as the sampling)."""
    nothing = no_logprobs(raw_logits.shape[0], num_top_logprobs)

    def compute(raw: jax.Array):
        log_total = jax.nn.logsumexp(raw, axis=-1)  # [R]
        token_logits = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]  # [R]
        wants_top = jnp.any(params.wants_top_logprobs)
        top_logits, top_ids = jax.lax.cond(
            wants_top, lambda x: top_k(x, num_top_logprobs, on_cuda), lambda x: nothing[2:], raw
        )
        ranks = _sampled_ranks(raw, token_logits, top_logits, wants_top, params.wants_logprobs, on_cuda)
        return token_logits - log_total, ranks, top_logits - log_total[:, None], top_ids.astype(jnp.int32)

    def skip(raw: jax.Array):
        return nothing

    return jax.lax.cond(jnp.any(params.wants_logprobs), compute, skip, raw_logits)


def _sampled_ranks(
    raw: jax.Array,  # f32[R, V]
    token_logits: jax.Array,  # f32[R]: the sampled tokens'
    top_logits: jax.Array,  # f32[R, L]: each row's L largest, where `has_top`
    has_top: jax.Array,  # bool[]
    wants: jax.Array,  # bool[R]: the rows that report a rank
    on_cuda: bool,
) -> jax.Array:  # i32[R]
    """`rank_of(raw, token_logits)`. On CPUs a pass over [R, V] costs as much as the log-softmax, and a
    sampled token among its row's top L has its rank there (everything above it is among them too): the
    pass runs only when some row's token is not. On CUDA GPUs the pass, at memory speed, beats a
    conditional (its predicate read on the host)."""
    if on_cuda or top_logits.shape[-1] == 0:
        return rank_of(raw, token_logits)
    in_top = has_top & (token_logits >= top_logits[:, -1])  # [R]
    return jax.lax.cond(jnp.all(in_top | ~wants), lambda x: rank_of(top_logits, token_logits),
                        lambda x: rank_of(x, token_logits), raw)


def _row_uniforms(params: SamplingArrays) -> jax.Array:  # f32[R] in [0, 1)
    """Each row's uniform for its draw, from its own key, fold_in(key(seed), output_index) (the module's
    docstring)."""
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(params.seeds, params.output_index)
    return jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys)


def sample_greedy(logits: jax.Array, num_top_logprobs: int) -> SamplerOutput:  # f32[R, V]
    """`sample` for a batch whose every row is greedy and asks for nothing more (no logprobs, grammar,
    bias, ban or penalty): the argmax, with no control flow. On a GPU each top-level `lax.cond` reads its
    predicate on the host, a stall every step; a plain greedy decode needs none of `sample`'s stages."""
    token_logprobs, ranks, top_logprobs, top_ids = no_logprobs(logits.shape[0], num_top_logprobs)
    return SamplerOutput(first_argmax(logits), token_logprobs, ranks, top_ids, top_logprobs)


def sample(
    logits: jax.Array,  # f32[R, V]
    params: SamplingArrays,
    tables: PenaltyTables,
    num_top_logprobs: int,
    on_cuda: bool = False,  # the target is a CUDA GPU (the module's docstring)
) -> SamplerOutput:
    is_greedy = params.temperature == GREEDY_TEMPERATURE  # the row of a greedy request (`SAMPLING_ROW`)
    # Drawn here, once, rather than where they are used: `choose` is traced into both branches of the
    # conditional below, which would compile the draw's hash (threefry's rounds) twice; R numbers cost
    # nothing next to the [R, V] work.
    uniforms = _row_uniforms(params)  # f32[R]

    def random_tokens(logits: jax.Array) -> jax.Array:
        temperature = jnp.where(is_greedy, 1.0, params.temperature)
        probs = jnp.exp((logits - logits.max(axis=-1, keepdims=True)) / temperature[:, None])  # [R, V], max 1
        floor = _keep_floor(probs, params)  # [R]
        return sample_categorical(jnp.where(probs >= floor[:, None], probs, 0.0), uniforms)

    def choose(logits: jax.Array) -> jax.Array:  # f32[R, V] -> i32[R]
        greedy_tokens = first_argmax(logits)
        mixed = lambda x: jnp.where(is_greedy, greedy_tokens, random_tokens(x))  # noqa: E731
        return jax.lax.cond(jnp.all(is_greedy), lambda x: greedy_tokens, mixed, logits)

    # Branches that return tokens, not logits: a cond passing [R, V] logits through unchanged copies them.
    tokens = jax.lax.cond(
        _modifies_logits(params, tables),
        lambda x: choose(_process_logits(x, params, tables, skip_unused=not on_cuda)), choose, logits,
    )
    token_logprobs, ranks, top_logprobs, top_ids = _reported_logprobs(logits, tokens, params, num_top_logprobs,
                                                                      on_cuda)
    return SamplerOutput(tokens, token_logprobs, ranks, top_ids, top_logprobs)
