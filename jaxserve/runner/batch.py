"""StepBatch: everything one step reads, padded to its bucket; built on the host in numpy."""

from dataclasses import dataclass

import jax
import numpy as np

from jaxserve.engine.scheduler import SchedulerOutput
from jaxserve.models.layers import AttentionMetadata
from jaxserve.runner.buckets import Bucket


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters, so one batch mixes greedy, temperature, top-k/p and min-p rows."""

    temperature: jax.Array  # f32[R]; 0 = greedy
    top_k: jax.Array  # i32[R]; 0 = off
    top_p: jax.Array  # f32[R]; 1 = off
    min_p: jax.Array  # f32[R]; 0 = off
    seeds: jax.Array  # u32[R]
    output_index: jax.Array  # i32[R]: which output token this is, so a seed reproduces


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepBatch:
    """Array shapes are the bucket: T tokens, R requests, P pages per request."""

    input_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    attention: AttentionMetadata
    logits_indices: jax.Array  # i32[R]: the packed index of each request's last token
    sampling: SamplingArrays


def build_step_batch(
    scheduler_output: SchedulerOutput,
    bucket: Bucket,
    page_size: int,
    max_pages_per_req: int,
    padding_slot: int,
) -> StepBatch:
    num_tokens, num_reqs = bucket.num_tokens, bucket.num_reqs
    input_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.full(num_tokens, padding_slot, np.int32)
    kv_lens = np.zeros(num_reqs, np.int32)
    page_table = np.zeros((num_reqs, max_pages_per_req), np.int32)  # page 0: scratch, masked
    cu_q_lens = np.zeros(num_reqs + 1, np.int32)
    logits_indices = np.zeros(num_reqs, np.int32)
    temperature = np.zeros(num_reqs, np.float32)
    top_k = np.zeros(num_reqs, np.int32)
    top_p = np.ones(num_reqs, np.float32)
    min_p = np.zeros(num_reqs, np.float32)
    seeds = np.zeros(num_reqs, np.uint32)
    output_index = np.zeros(num_reqs, np.int32)

    offset = 0
    for row, item in enumerate(scheduler_output.scheduled):
        n = len(item.token_ids)
        start, end = item.start_position, item.start_position + n
        token_positions = np.arange(start, end, dtype=np.int32)
        pages = np.asarray(item.page_ids, np.int32)
        input_ids[offset : offset + n] = item.token_ids
        positions[offset : offset + n] = token_positions
        slot_mapping[offset : offset + n] = pages[token_positions // page_size] * page_size + (
            token_positions % page_size
        )
        kv_lens[row] = end
        page_table[row, : len(pages)] = pages
        offset += n
        cu_q_lens[row + 1] = offset
        logits_indices[row] = offset - 1

        request = item.request
        params = request.sampling_params
        temperature[row] = 0.0 if params.is_greedy else params.temperature
        top_k[row] = params.top_k
        top_p[row] = params.top_p
        min_p[row] = params.min_p
        seeds[row] = request.sampling_seed
        output_index[row] = request.num_output_tokens
    cu_q_lens[len(scheduler_output.scheduled) + 1 :] = offset  # padded requests: q_len 0, kv_len 0

    return StepBatch(
        input_ids=input_ids,
        positions=positions,
        attention=AttentionMetadata(
            slot_mapping=slot_mapping, kv_lens=kv_lens, page_table=page_table, cu_q_lens=cu_q_lens
        ),
        logits_indices=logits_indices,
        sampling=SamplingArrays(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            seeds=seeds, output_index=output_index,
        ),
    )
