"""StepBatch: everything one step reads, padded to its bucket; built on the host in numpy."""

from dataclasses import dataclass

import jax
import numpy as np

from jaxserve.engine.request import RequestFault
from jaxserve.engine.scheduler import PENDING_TOKEN, ScheduledRequest, SchedulerOutput
from jaxserve.engine.structured_output import GrammarMatcher, MaskFiller, bitmask_words
from jaxserve.models.layers import AttentionMetadata
from jaxserve.runner.buckets import Bucket
from jaxserve.runner.penalties import PenaltyUpdates

# logit_bias entries, plus the EOS / stop ids that min_tokens bans, per request and step.
MAX_BIASED_TOKENS = 128


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters, so one batch mixes any settings. Neutral values switch a feature off."""

    temperature: jax.Array  # f32[R]; 0 = greedy
    top_k: jax.Array  # i32[R]; 0 = off
    top_p: jax.Array  # f32[R]; 1 = off
    min_p: jax.Array  # f32[R]; 0 = off
    seeds: jax.Array  # u32[R]
    output_index: jax.Array  # i32[R]: which output token this is, so a seed reproduces
    bias_token_ids: jax.Array  # i32[R, B]: V (out of range) pads
    bias_values: jax.Array  # f32[R, B]: added to the logits; -inf bans (min_tokens)
    penalty_slots: jax.Array  # i32[R]: the row in the penalty tables; S = none
    repetition_penalty: jax.Array  # f32[R]; 1 = off
    frequency_penalty: jax.Array  # f32[R]; 0 = off
    presence_penalty: jax.Array  # f32[R]; 0 = off
    wants_top_logprobs: jax.Array  # bool[R]
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


@dataclass(frozen=True)
class BatchLayout:
    """The fixed facts build_step_batch needs besides the schedule and the bucket."""

    page_size: int
    max_pages_per_req: int
    padding_slot: int  # KV slot index that scatters drop
    vocab_size: int
    num_penalty_slots: int
    max_num_seqs: int  # M: rows the previous step's samples are kept for


def banned_and_biased(item: ScheduledRequest) -> dict[int, float]:
    """token id -> bias for this step: the request's logit_bias, and -inf on the ids it may not sample
    (min_tokens' bans, decided by the engine)."""
    bias = dict(item.sampling_params.logit_bias)
    bias.update(dict.fromkeys(item.banned_token_ids, -np.inf))
    return bias


_masks = MaskFiller()


def build_step_batch(
    scheduler_output: SchedulerOutput,
    bucket: Bucket,
    layout: BatchLayout,
    penalty_slots: list[int | None],  # per scheduled request
    previous_rows: dict[str, int] | None = None,  # request id -> its row in the previous step
) -> StepBatch:
    num_tokens, num_reqs = bucket.num_tokens, bucket.num_reqs
    page_size, no_slot = layout.page_size, layout.num_penalty_slots
    input_ids = np.zeros(num_tokens, np.int32)
    input_from_row = np.full(num_tokens, layout.max_num_seqs, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.full(num_tokens, layout.padding_slot, np.int32)
    kv_lens = np.zeros(num_reqs, np.int32)
    page_table = np.zeros((num_reqs, layout.max_pages_per_req), np.int32)  # page 0: scratch, masked
    cu_q_lens = np.zeros(num_reqs + 1, np.int32)
    logits_indices = np.zeros(num_reqs, np.int32)
    temperature = np.zeros(num_reqs, np.float32)
    top_k = np.zeros(num_reqs, np.int32)
    top_p = np.ones(num_reqs, np.float32)
    min_p = np.zeros(num_reqs, np.float32)
    seeds = np.zeros(num_reqs, np.uint32)
    output_index = np.zeros(num_reqs, np.int32)
    bias_token_ids = np.full((num_reqs, MAX_BIASED_TOKENS), layout.vocab_size, np.int32)
    bias_values = np.zeros((num_reqs, MAX_BIASED_TOKENS), np.float32)
    row_slots = np.full(num_reqs, no_slot, np.int32)
    repetition = np.ones(num_reqs, np.float32)
    frequency = np.zeros(num_reqs, np.float32)
    presence = np.zeros(num_reqs, np.float32)
    wants_top_logprobs = np.zeros(num_reqs, np.bool_)
    token_bitmask = np.full((num_reqs, bitmask_words(layout.vocab_size)), -1, np.int32)
    constrained = np.zeros(num_reqs, np.bool_)
    grammar_rows: list[tuple[GrammarMatcher, int]] = []
    reset_slots = np.full(num_reqs, no_slot, np.int32)
    prompt_token_slots = np.full(num_tokens, no_slot, np.int32)
    output_token_slots = np.full(num_tokens, no_slot, np.int32)
    prompt_logprob_targets = np.full(num_tokens, layout.vocab_size, np.int32)

    offset = 0
    for row, (item, slot) in enumerate(zip(scheduler_output.scheduled, penalty_slots, strict=True)):
        try:
            n = len(item.token_ids)
            start, end = item.start_position, item.start_position + n
            token_positions = np.arange(start, end, dtype=np.int32)
            pages = np.asarray(item.page_ids, np.int32)
            input_ids[offset : offset + n] = item.token_ids
            if item.token_ids[-1] == PENDING_TOKEN:  # sampled by the previous step, still on the device
                input_ids[offset + n - 1] = 0
                input_from_row[offset + n - 1] = previous_rows[item.request_id]
            positions[offset : offset + n] = token_positions
            slot_mapping[offset : offset + n] = pages[token_positions // page_size] * page_size + (
                token_positions % page_size
            )
            kv_lens[row] = end
            page_table[row, : len(pages)] = pages

            params = item.sampling_params
            if slot is not None:
                row_slots[row] = slot
                if start == 0:
                    reset_slots[row] = slot
                is_prompt = token_positions < item.num_prompt_tokens
                prompt_token_slots[offset : offset + n] = np.where(is_prompt, slot, no_slot)
                output_token_slots[offset : offset + n] = np.where(is_prompt, no_slot, slot)
                repetition[row] = params.repetition_penalty
                frequency[row] = params.frequency_penalty
                presence[row] = params.presence_penalty

            scored = item.prompt_logprob_targets  # position p scores prompt token p + 1
            prompt_logprob_targets[offset : offset + len(scored)] = scored

            offset += n
            cu_q_lens[row + 1] = offset
            logits_indices[row] = offset - 1
            temperature[row] = 0.0 if params.is_greedy else params.temperature
            top_k[row] = params.top_k
            top_p[row] = params.top_p
            min_p[row] = params.min_p
            seeds[row] = item.sampling_seed
            output_index[row] = item.num_output_tokens
            wants_top_logprobs[row] = bool(params.logprobs)
            if item.grammar is not None:  # set only when the sample is kept (a prefill chunk's is dropped)
                constrained[row] = True
                grammar_rows.append((item.grammar, row))
            bias = banned_and_biased(item)
            bias_token_ids[row, : len(bias)] = list(bias)
            bias_values[row, : len(bias)] = list(bias.values())
        except Exception as e:  # one request's values must not fail the whole step
            raise RequestFault(item.request_id) from e
    cu_q_lens[len(scheduler_output.scheduled) + 1 :] = offset  # padded requests: q_len 0, kv_len 0
    _masks.fill(grammar_rows, token_bitmask)  # after reading the last step's tokens, before this one runs

    return StepBatch(
        input_ids=input_ids,
        input_from_row=input_from_row,
        previous_tokens=np.zeros(layout.max_num_seqs, np.int32),
        positions=positions,
        attention=AttentionMetadata(
            slot_mapping=slot_mapping, kv_lens=kv_lens, page_table=page_table, cu_q_lens=cu_q_lens,
            decode_only=bucket.decode_only,
        ),
        logits_indices=logits_indices,
        sampling=SamplingArrays(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            seeds=seeds, output_index=output_index,
            bias_token_ids=bias_token_ids, bias_values=bias_values,
            penalty_slots=row_slots, repetition_penalty=repetition,
            frequency_penalty=frequency, presence_penalty=presence,
            wants_top_logprobs=wants_top_logprobs,
            token_bitmask=token_bitmask, constrained=constrained,
        ),
        penalty_updates=PenaltyUpdates(
            reset_slots=reset_slots, prompt_token_slots=prompt_token_slots,
            output_token_slots=output_token_slots,
        ),
        prompt_logprob_targets=prompt_logprob_targets,
    )
