"""Repetition, frequency and presence penalties without leaving the device.

Penalties depend on every token a request has seen. Rather than shipping those lists each step, the
runner keeps two tables on the device, one row per *slot* (a running request's row in the runner's
persistent batch, `request_rows`; it is the request's slot when the request uses penalties):

    output_counts  i32[S, V]   how often each token was generated
    prompt_mask    bool[S, V]  which tokens occur in the prompt (repetition_penalty looks at both)

The step's own input tokens feed the tables: a prefill chunk's prompt tokens set `prompt_mask`, and a
decode's input (the token sampled last step) increments `output_counts`, before the logits are
penalised. A request starting at position 0 (new, or recomputed after preemption) clears its row
first, so recomputation never double-counts. Rows without a slot use index S, which scatters drop.

A request that starts after a prefix-cache hit never feeds its cached tokens through a step, so its row
is written whole from the host first (`load_row`, `seen_tokens`), as if those tokens had been fed.

A speculative decode gives a request one row per draft position, all on its one slot. Row j (j >= 1) feeds
draft j - 1, which is not counted when the step starts (the draft may be rejected): the row's penalties
count the drafts before its position on top of the slot's counts (`drafts`, vLLM's rejection sampler
does the same), and once the step has sampled, each draft that the verification accepts (every draft up
to it matched the sample before it) is counted into the slot (`count_accepted_drafts`): the rule the
scheduler verifies by, so the slot then holds every output but the last sample, which the next step
counts as its input, as after a plain decode.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PenaltyTables:
    output_counts: jax.Array  # i32[S, V]
    prompt_mask: jax.Array  # bool[S, V]

    @staticmethod
    def num_bytes(num_slots: int, vocab_size: int) -> int:
        return num_slots * vocab_size * (4 + 1)  # i32 counts and a bool mask per slot and token

    @classmethod
    def zeros(cls, num_slots: int, vocab_size: int) -> "PenaltyTables":
        return cls(
            output_counts=jnp.zeros((num_slots, vocab_size), jnp.int32),
            prompt_mask=jnp.zeros((num_slots, vocab_size), jnp.bool_),
        )


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PenaltyUpdates:
    """How this step's inputs change the tables; slot S (out of range) means "no slot"."""

    reset_slots: jax.Array  # i32[R]: rows to clear before counting (requests starting at position 0)
    prompt_token_slots: jax.Array  # i32[T]: the slot of each input token that is a prompt token
    output_token_slots: jax.Array  # i32[T]: the slot of each input token that is a generated token


def update_tables(tables: PenaltyTables, input_ids: jax.Array, updates: PenaltyUpdates,
                  skip_untouched: bool = True) -> PenaltyTables:
    """The tables after this step's resets and tokens. `skip_untouched`: behind a `lax.cond` that skips the
    scatters when no row has a slot (most steps), as on CPUs, where even scatters that drop every index cost
    tens of microseconds. Off on CUDA GPUs: XLA:GPU copies a conditional's operands (both tables, whole,
    every step: 64 MB at 256 sequences of GPT-2's vocabulary) where the scatters cost a few small kernels."""
    num_slots = tables.output_counts.shape[0]

    def update(tables: PenaltyTables) -> PenaltyTables:
        counts = tables.output_counts.at[updates.reset_slots].set(0, mode="drop")
        mask = tables.prompt_mask.at[updates.reset_slots].set(False, mode="drop")
        counts = counts.at[updates.output_token_slots, input_ids].add(1, mode="drop")
        mask = mask.at[updates.prompt_token_slots, input_ids].set(True, mode="drop")
        return PenaltyTables(counts, mask)

    if not skip_untouched:
        return update(tables)
    touched = jnp.any(updates.reset_slots < num_slots) | jnp.any(updates.prompt_token_slots < num_slots)
    touched |= jnp.any(updates.output_token_slots < num_slots)
    return jax.lax.cond(touched, update, lambda t: t, tables)


def count_outputs(tables: PenaltyTables, token_ids: jax.Array, slots: jax.Array,
                  skip_untouched: bool = True) -> PenaltyTables:
    """The tables with each token i32[R] counted once more as generated in its row's slot i32[R] (S: none):
    a multi-step decode's step feeding the last step's samples, a speculative decode's accepted drafts.
    `skip_untouched` as in `update_tables`."""
    num_slots = tables.output_counts.shape[0]

    def count(tables: PenaltyTables) -> PenaltyTables:
        return PenaltyTables(tables.output_counts.at[slots, token_ids].add(1, mode="drop"), tables.prompt_mask)

    if not skip_untouched:
        return count(tables)
    return jax.lax.cond(jnp.any(slots < num_slots), count, lambda t: t, tables)


def count_accepted_drafts(tables: PenaltyTables, drafts: jax.Array, tokens: jax.Array, slots: jax.Array,
                          skip_untouched: bool = True) -> PenaltyTables:
    """The tables with each accepted draft counted as generated in its request's slot. `drafts` i32[R, D]:
    each row's drafts before its position (V pads; a row at draft position j has j, its request's rows
    being consecutive), `tokens` i32[R] the step's samples, `slots` i32[R] (S: none). Row i at position
    j >= 1 fed draft j - 1, which is accepted when the samples of rows i - j .. i - 1 are drafts 0 .. j - 1.
    `skip_untouched` as in `update_tables`."""
    num_rows, depth = drafts.shape
    if depth == 0:  # no speculative decoding: nothing to count
        return tables
    num_slots, vocab_size = tables.output_counts.shape
    is_draft = drafts < vocab_size  # [R, D]
    position = jnp.sum(is_draft, axis=1)  # [R]: j
    before = jnp.arange(num_rows)[:, None] - position[:, None] + jnp.arange(depth)  # [R, D]: rows i - j + k
    samples = tokens[jnp.clip(before, 0, num_rows - 1)]  # [R, D]
    accepted = (position > 0) & jnp.all((samples == drafts) | ~is_draft, axis=1)  # [R]
    fed = jnp.take_along_axis(drafts, jnp.maximum(position - 1, 0)[:, None], axis=1)[:, 0]  # [R]: draft j - 1
    return count_outputs(tables, fed, jnp.where(accepted, slots, num_slots), skip_untouched)


def apply_penalties(
    logits: jax.Array,  # f32[R, V]
    tables: PenaltyTables,
    slots: jax.Array,  # i32[R]; S for rows without penalties
    drafts: jax.Array,  # i32[R, D]: the drafts before a speculative row's position, counted too; V pads
    repetition: jax.Array,  # f32[R]; 1 = off
    frequency: jax.Array,  # f32[R]; 0 = off
    presence: jax.Array,  # f32[R]; 0 = off
    fused: bool = False,
) -> jax.Array:  # f32[R, V]
    """vLLM's semantics: repetition divides positive logits (multiplies negative ones) of every token
    seen in the prompt or output; frequency and presence subtract per generated occurrence / once.
    `fused` (CUDA GPUs): the drafts are counted by comparison with the vocabulary's ids, elementwise work
    that fuses with the penalties' (a scatter would write the gathered [R, V] counts out and read them
    back); else by a scatter of their R x D ids, where a comparison per draft would cost a pass over [R, V]."""
    rows = jnp.minimum(slots, tables.output_counts.shape[0] - 1)  # rows without a slot: penalties are off
    counts = tables.output_counts[rows]  # [R, V]
    if drafts.shape[1] and fused:
        vocab_ids = jnp.arange(counts.shape[1], dtype=drafts.dtype)
        for k in range(drafts.shape[1]):
            counts = counts + (drafts[:, k, None] == vocab_ids).astype(counts.dtype)
    elif drafts.shape[1]:
        counts = counts.at[jnp.arange(drafts.shape[0])[:, None], drafts].add(1, mode="drop")
    counts = counts.astype(jnp.float32)
    seen = (counts > 0) | tables.prompt_mask[rows]
    rep = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def load_row(tables: PenaltyTables, slot: jax.Array, prompt_mask: jax.Array, output_counts: jax.Array) -> PenaltyTables:
    """Overwrites row `slot` (i32[]) with a prompt mask bool[V] and output counts i32[V]."""
    return PenaltyTables(tables.output_counts.at[slot].set(output_counts), tables.prompt_mask.at[slot].set(prompt_mask))


def seen_tokens(token_ids: list[int], num_prompt_tokens: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A row for `token_ids` (a request's first tokens, prompt first): bool[V] prompt mask, i32[V] counts."""
    prompt_mask = np.zeros(vocab_size, np.bool_)
    prompt_mask[token_ids[:num_prompt_tokens]] = True
    output_counts = np.bincount(token_ids[num_prompt_tokens:], minlength=vocab_size).astype(np.int32)
    return prompt_mask, output_counts
