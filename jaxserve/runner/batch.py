"""Building a step's batch: the scheduler's plan and the requests' persistent rows into a `StepBatch`, padded
to its bucket (numpy, on the host)."""

import dataclasses

import numpy as np

from jaxserve.engine.step_io import PENDING_TOKEN, RequestFault, SchedulerOutput
from jaxserve.runner.buckets import Bucket
from jaxserve.runner.packing import neutral_batch
from jaxserve.runner.request_rows import SAMPLING_COLUMNS, RequestRows
from jaxserve.runner.step_batch import MAX_BIASED_TOKENS, BatchLayout, StepBatch


def build_step_batch(
    plan: SchedulerOutput,
    bucket: Bucket,
    layout: BatchLayout,
    rows: RequestRows,
    row_ids: np.ndarray,  # intp[n]: each step row's request row in `rows`
) -> StepBatch:
    """The step's arrays: the requests' persistent rows gathered, the step's own columns filled for all rows
    at once, and only rows using rare features (penalties, biases, bans, prompt logprobs, allowed tokens, a
    grammar) filled one by one (a Python loop over every row costs 20 us a row, 5 ms a step at 256 decodes).
    A value that cannot go in its column (one request's bad data) raises RequestFault for that request: the
    rows are filled again one at a time to find it."""
    batch = neutral_batch(bucket, layout)
    try:
        biases, allowed = _fill_rows(batch, plan, rows, row_ids, layout)
    except Exception as error:
        for row in range(plan.num_reqs):
            try:
                _fill_rows(neutral_batch(bucket, layout), _one_row(plan, row), rows, row_ids[row : row + 1], layout)
            except Exception as e:  # one request's values must not fail the whole step
                raise RequestFault(plan.request_ids[row]) from e
        raise error
    if not biases and not allowed and not plan.grammar_rows:
        return batch
    sampling = batch.sampling
    bias_token_ids, bias_values, token_bitmask = sampling.bias_token_ids, sampling.bias_values, sampling.token_bitmask
    if biases:
        bias_token_ids, bias_values = bias_token_ids.copy(), bias_values.copy()
        for row, token_ids, values in biases:
            bias_token_ids[row, : len(token_ids)] = token_ids
            bias_values[row, : len(values)] = values
    if plan.grammar_rows or allowed:
        token_bitmask = token_bitmask.copy()
    if plan.grammar_rows:  # their masks, filled by the engine after it read the last step's tokens
        token_bitmask[list(plan.grammar_rows)] = plan.grammar_bitmask
        sampling.constrained[list(plan.grammar_rows)] = True
    for row, mask in allowed:  # allowed_token_ids: alone, or within the grammar's mask
        token_bitmask[row] = token_bitmask[row] & mask if sampling.constrained[row] else mask
        sampling.constrained[row] = True
    sampling = dataclasses.replace(sampling, bias_token_ids=bias_token_ids, bias_values=bias_values,
                                   token_bitmask=token_bitmask)
    return dataclasses.replace(batch, sampling=sampling)


def _one_row(plan: SchedulerOutput, row: int) -> SchedulerOutput:
    """The plan's row `row` alone, as row 0 of a plan (to find which row's values fail)."""
    first = sum(plan.num_new_tokens[:row])
    end = first + plan.num_new_tokens[row]
    pick = (lambda sparse: {0: sparse[row]} if row in sparse else {})  # noqa: E731
    return SchedulerOutput(
        [plan.request_ids[row]], [plan.num_new_tokens[row]], plan.token_ids[first:end], [plan.start_positions[row]],
        [plan.output_indices[row]], [plan.keeps_sample[row]], new_pages=pick(plan.new_pages),
        banned_token_ids=pick(plan.banned_token_ids), prompt_logprob_targets=pick(plan.prompt_logprob_targets),
    )


def _draft_positions(plan: SchedulerOutput) -> np.ndarray | None:
    """A speculative plan's rows' draft positions i64[n] (0: a request's first row, j: the row feeding its
    draft j - 1); None for a plan without drafts."""
    if not plan.draft_lengths:
        return None
    lengths = np.array(plan.draft_lengths, np.int64) + 1  # [s]: rows per request
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)  # [n]: each row's request's first row
    return np.arange(int(lengths.sum())) - starts


def _fill_rows(
    batch: StepBatch,
    plan: SchedulerOutput,
    rows: RequestRows,
    row_ids: np.ndarray,
    layout: BatchLayout,
) -> tuple[list[tuple[int, np.ndarray, np.ndarray]], list[tuple[int, np.ndarray]]]:
    """Writes the plan's rows into rows 0.. of a neutral batch; returns the biased rows as (row, token ids
    i32[k], biases f32[k]) and the rows with allowed tokens as (row, bitmask i32[W]), written afterwards
    into copies of the shared bias and bitmask arrays."""
    num_rows = plan.num_reqs
    if not num_rows:
        return [], []
    attention, sampling, penalties = batch.attention, batch.sampling, batch.penalty_updates
    lengths = np.array(plan.num_new_tokens, np.int64)  # [n]
    cu_lens = np.zeros(num_rows + 1, np.int64)  # [n + 1]
    np.cumsum(lengths, out=cu_lens[1:])
    total = int(cu_lens[-1])
    row_of_token = np.repeat(np.arange(num_rows), lengths)  # [total]
    starts = np.array(plan.start_positions, np.int64)  # [n]
    positions = starts[row_of_token] + np.arange(total) - cu_lens[row_of_token]  # [total]

    token_ids = np.array(plan.token_ids, np.int64)  # [total]
    pending = token_ids == PENDING_TOKEN  # sampled by the previous step, still on the device
    batch.input_ids[:total] = np.where(pending, 0, token_ids)
    if pending.any():  # async scheduling: each takes its sample from the row it had in the previous step
        batch.input_from_row[:total][pending] = rows.in_flight_sample_rows(row_ids[row_of_token[pending]])
    batch.positions[:total] = positions
    batch.lora_slots[:total] = rows.lora_slots[row_ids][row_of_token]

    np.take(rows.page_table, row_ids, axis=0, out=attention.page_table[:num_rows])  # [n, P]
    page_size = layout.page_size
    attention.slot_mapping[:total] = (attention.page_table[row_of_token, positions // page_size] * page_size
                                      + positions % page_size)
    attention.kv_lens[:num_rows] = starts + lengths
    attention.cu_q_lens[: num_rows + 1] = cu_lens
    attention.cu_q_lens[num_rows + 1 :] = total  # padded requests: q_len 0, kv_len 0
    batch.logits_indices[:num_rows] = cu_lens[1:] - 1

    for name in SAMPLING_COLUMNS:
        np.take(getattr(rows, name), row_ids, out=getattr(sampling, name)[:num_rows])
    sampling.output_index[:num_rows] = plan.output_indices

    # Features few requests use: row by row, only for the rows that use them.
    biases, allowed = [], []
    no_slot = layout.num_penalty_slots
    draft_positions = _draft_positions(plan)  # [n], or None without drafts
    for row in np.flatnonzero(rows.row_features[row_ids]).tolist():
        request_row = row_ids[row]
        first, end = cu_lens[row], cu_lens[row + 1]
        slot = int(sampling.penalty_slots[row])
        if slot != no_slot and draft_positions is not None and (position := draft_positions[row]):
            # a draft's row: its input is counted once accepted; its penalties count the drafts before it
            sampling.penalty_drafts[row, :position] = token_ids[cu_lens[row - position + 1 : row + 1]]
        elif slot != no_slot:
            if starts[row] == 0:  # new or recomputed: the step clears its penalty row
                penalties.reset_slots[row] = slot
            is_prompt = positions[first:end] < rows.num_prompt_tokens[request_row]
            penalties.prompt_token_slots[first:end] = np.where(is_prompt, slot, no_slot)
            penalties.output_token_slots[first:end] = np.where(is_prompt, no_slot, slot)
        targets = plan.prompt_logprob_targets.get(row)
        if targets:  # position p scores prompt token p + 1
            batch.prompt_logprob_targets[first : first + len(targets)] = targets
        logit_bias, banned = rows.logit_bias[request_row], plan.banned_token_ids.get(row, ())
        if logit_bias or banned:
            bias = dict(logit_bias)
            bias.update(dict.fromkeys(banned, -np.inf))  # min_tokens' bans, decided by the engine
            if len(bias) > MAX_BIASED_TOKENS:
                raise ValueError(f"{len(bias)} biased tokens, at most {MAX_BIASED_TOKENS}")
            biases.append((row, np.array(list(bias), np.int32), np.array(list(bias.values()), np.float32)))
        if (mask := rows.allowed_masks[request_row]) is not None:
            allowed.append((row, mask))
    return biases, allowed
