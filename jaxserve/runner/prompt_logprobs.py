"""Prompt logprobs inside the jitted step: the log-probability of each prompt token given the ones before.

A request that asks for them (vLLM's `prompt_logprobs`, or `echo` with `logprobs`) computes its whole
prompt, and each step's chunk of it yields, at every position p, the distribution of the token at p + 1.
The step marks those positions with the token to score (`targets`); everything else holds V, and when no
position is marked the work is skipped behind a `lax.cond`. Logits are never materialised for the whole
step at once: the hidden states go through the LM head `CHUNK` tokens at a time, so the memory is
[CHUNK, V] whatever the bucket (a [T, V] log-softmax of an 8k-token chunk and a 128k vocabulary would be
4 GiB in float32).
"""

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.runner.selection import rank_of, top_k

CHUNK = 128  # tokens per pass through the LM head


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PromptLogprobs:
    token_logprobs: jax.Array  # f32[T]: logprob of the target token at each position (0 where none)
    ranks: jax.Array  # i32[T]: its rank in the distribution, 1 = the most likely
    top_token_ids: jax.Array  # i32[T, L]: the L most likely tokens
    top_logprobs: jax.Array  # f32[T, L]


def no_prompt_logprobs(num_tokens: int, num_top: int) -> PromptLogprobs:
    """What `prompt_logprobs` gives when no position is marked."""
    return PromptLogprobs(jnp.zeros(num_tokens, jnp.float32), jnp.zeros(num_tokens, jnp.int32),
                          jnp.zeros((num_tokens, num_top), jnp.int32), jnp.zeros((num_tokens, num_top), jnp.float32))


def prompt_logprobs(
    compute_logits: Callable[[jax.Array], jax.Array],  # [C, D] -> f32[C, V]
    hidden: jax.Array,  # [T, D]
    targets: jax.Array,  # i32[T]: the token to score at each position; V = none
    vocab_size: int,
    num_top: int,
    on_cuda: bool = False,  # the target is a CUDA GPU (`selection.top_k`)
    chunk: int = CHUNK,
) -> PromptLogprobs:
    num_tokens, dim = hidden.shape
    chunk = min(num_tokens, chunk)
    padding = -num_tokens % chunk

    def score(chunk_in: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        hidden, targets = chunk_in  # [C, D], i32[C]
        logprobs = jax.nn.log_softmax(compute_logits(hidden), axis=-1)  # f32[C, V]
        target = jnp.take_along_axis(logprobs, jnp.minimum(targets, vocab_size - 1)[:, None], axis=-1)[:, 0]  # [C]
        top_logprobs, top_ids = top_k(logprobs, num_top, on_cuda)  # [C, L]
        return target, rank_of(logprobs, target), top_ids.astype(jnp.int32), top_logprobs

    def compute(hidden: jax.Array) -> PromptLogprobs:
        chunks = (
            jnp.pad(hidden, ((0, padding), (0, 0))).reshape(-1, chunk, dim),  # [N, C, D]
            jnp.pad(targets, (0, padding), constant_values=vocab_size).reshape(-1, chunk),  # [N, C]
        )
        return PromptLogprobs(*(x.reshape(-1, *x.shape[2:])[:num_tokens] for x in jax.lax.map(score, chunks)))

    return jax.lax.cond(jnp.any(targets < vocab_size), compute, lambda _: no_prompt_logprobs(num_tokens, num_top),
                        hidden)
