"""The step's inputs as types: `StepBatch` (its shapes are the bucket), its per-row `SamplingArrays`, and the
padding batch every step starts from (numpy on the host, device arrays inside the step)."""

import functools
from dataclasses import dataclass

import jax
import numpy as np

from jaxserve.engine.step_io import NO_LORA_SLOT, bitmask_words
from jaxserve.models.layers import AttentionMetadata
from jaxserve.runner.buckets import Bucket
from jaxserve.runner.penalties import PenaltyUpdates
from jaxserve.sampling_params import SAMPLING_ROW

# logit_bias entries, plus the EOS / stop ids that min_tokens bans, per request and step.
MAX_BIASED_TOKENS = 128


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters, so one batch mixes any settings. Neutral values switch a feature off
    (`sampling_params.SAMPLING_ROW` names the first nine, their dtypes and neutral values)."""

    temperature: jax.Array  # f32[R]; GREEDY_TEMPERATURE (0) = greedy
    top_k: jax.Array  # i32[R]; 0 = off
    top_p: jax.Array  # f32[R]; 1 = off
    min_p: jax.Array  # f32[R]; 0 = off
    repetition_penalty: jax.Array  # f32[R]; 1 = off
    frequency_penalty: jax.Array  # f32[R]; 0 = off
    presence_penalty: jax.Array  # f32[R]; 0 = off
    wants_logprobs: jax.Array  # bool[R]: the sampled token's logprob is reported
    wants_top_logprobs: jax.Array  # bool[R]: and its top alternatives
    seeds: jax.Array  # u32[R]
    penalty_slots: jax.Array  # i32[R]: the row in the penalty tables; S = none
    # i32[R, D]: a speculative decode's drafts before the row's position, which its penalties count (and the
    # step counts into its slot once accepted: `penalties.count_accepted_drafts`); V pads. D: the layout's.
    penalty_drafts: jax.Array
    output_index: jax.Array  # i32[R]: which output token this is, so a seed reproduces
    bias_token_ids: jax.Array  # i32[R, B]: V (out of range) pads
    bias_values: jax.Array  # f32[R, B]: added to the logits; -inf bans (min_tokens)
    token_bitmask: jax.Array  # i32[R, ceil(V/32)]: bit t of a constrained row allows token t
    constrained: jax.Array  # bool[R]: the row samples under its grammar's bitmask


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepBatch:
    """Array shapes are the bucket: T tokens, R requests, P pages per request."""

    input_ids: jax.Array  # i32[T]
    # i32[T]: the previous step's row whose sample is this token's input (async scheduling: not yet read
    # on the host); M = max_num_seqs where input_ids holds it.
    input_from_row: jax.Array
    previous_tokens: jax.Array  # i32[M]: the previous step's samples by row (the runner sets the device's)
    positions: jax.Array  # i32[T]
    attention: AttentionMetadata
    logits_indices: jax.Array  # i32[R]: the packed index of each request's last token
    sampling: SamplingArrays
    penalty_updates: PenaltyUpdates
    prompt_logprob_targets: jax.Array  # i32[T]: the next prompt token, to score; V where none is wanted
    lora_slots: jax.Array  # i32[T]: the LoRA slot of each token's adapter; NO_LORA_SLOT: the base model


@dataclass(frozen=True)
class BatchLayout:
    """The fixed facts build_step_batch needs besides the schedule and the bucket."""

    page_size: int
    max_pages_per_req: int
    padding_slot: int  # KV slot index that scatters drop
    vocab_size: int
    num_penalty_slots: int
    max_num_seqs: int  # M: rows the previous step's samples are kept for
    max_drafts: int = 0  # D: drafts a speculative decode verifies per request at most (0: none)


@functools.cache  # one per bucket size: the runner keys their device copies by identity
def _neutral_wide_inputs(num_reqs: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bias_token_ids, bias_values, token_bitmask) for a bucket where no row uses them: shared, read-only.
    They are 1.8 MB at 256 rows; the runner sends their device copies instead (`ModelRunner.run_step`)."""
    arrays = (np.full((num_reqs, MAX_BIASED_TOKENS), vocab_size, np.int32),
              np.zeros((num_reqs, MAX_BIASED_TOKENS), np.float32),
              np.full((num_reqs, bitmask_words(vocab_size)), -1, np.int32))
    for array in arrays:
        array.flags.writeable = False
    return arrays


def separate_neutral_batch(bucket: Bucket, layout: BatchLayout) -> StepBatch:
    """A batch of padding (no tokens, no requests, every feature off), each array on its own: the values
    every step starts from and the template `packing.batch_packing` lays out."""
    num_tokens, num_reqs, no_slot = bucket.num_tokens, bucket.num_reqs, layout.num_penalty_slots
    bias_token_ids, bias_values, token_bitmask = _neutral_wide_inputs(num_reqs, layout.vocab_size)
    return StepBatch(
        input_ids=np.zeros(num_tokens, np.int32),
        input_from_row=np.full(num_tokens, layout.max_num_seqs, np.int32),
        previous_tokens=np.zeros(layout.max_num_seqs, np.int32),
        positions=np.zeros(num_tokens, np.int32),
        attention=AttentionMetadata(
            slot_mapping=np.full(num_tokens, layout.padding_slot, np.int32),
            kv_lens=np.zeros(num_reqs, np.int32),
            page_table=np.zeros((num_reqs, layout.max_pages_per_req), np.int32),  # page 0: scratch, masked
            cu_q_lens=np.zeros(num_reqs + 1, np.int32),
            decode_only=bucket.decode_only,
        ),
        logits_indices=np.zeros(num_reqs, np.int32),
        sampling=SamplingArrays(
            **{column.name: np.full(num_reqs, column.neutral, column.dtype) for column in SAMPLING_ROW},
            seeds=np.zeros(num_reqs, np.uint32),
            penalty_slots=np.full(num_reqs, no_slot, np.int32),
            penalty_drafts=np.full((num_reqs, layout.max_drafts), layout.vocab_size, np.int32),
            output_index=np.zeros(num_reqs, np.int32),
            bias_token_ids=bias_token_ids,
            bias_values=bias_values,
            token_bitmask=token_bitmask,
            constrained=np.zeros(num_reqs, np.bool_),
        ),
        penalty_updates=PenaltyUpdates(
            reset_slots=np.full(num_reqs, no_slot, np.int32),
            prompt_token_slots=np.full(num_tokens, no_slot, np.int32),
            output_token_slots=np.full(num_tokens, no_slot, np.int32),
        ),
        prompt_logprob_targets=np.full(num_tokens, layout.vocab_size, np.int32),
        lora_slots=np.full(num_tokens, NO_LORA_SLOT, np.int32),
    )
