"""StepBatch: everything one step reads, padded to its bucket; built on the host in numpy.

Its narrow arrays (everything of [T], [R] or [R, P] shape) are views of two flat buffers, one of 4-byte
words (int32, uint32 and float32 by their bits) and one of booleans, so a step sends them as two arrays
(`PackedBatch`) and the step unpacks them by static slices: a call's argument handling and host-to-device
copies cost per array, and there are 25 of them.
"""

import dataclasses
import functools
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine.request import RequestFault
from jaxserve.engine.scheduler import NO_DECODES, PENDING_TOKEN, DecodeColumns, ScheduledRequest, SchedulerOutput
from jaxserve.engine.structured_output import MaskFiller, bitmask_words
from jaxserve.models.layers import AttentionMetadata
from jaxserve.runner.buckets import Bucket
from jaxserve.runner.penalties import PenaltyUpdates
from jaxserve.runner.request_rows import SAMPLING_COLUMNS, RequestRows

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
    wants_logprobs: jax.Array  # bool[R]: the sampled token's logprob is reported
    wants_top_logprobs: jax.Array  # bool[R]: and its top alternatives
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


# Inputs a step sends whole rather than in the packed buffers: the previous step's samples (already on the
# device) and the [R, vocabulary]-proportional sampling inputs (shared read-only arrays most steps).
_HELD_WHOLE = frozenset({"previous_tokens", "bias_token_ids", "bias_values", "token_bitmask"})
_WORDS, _FLAGS, _HELD = "words", "flags", "held"


@dataclass(frozen=True)
class _LeafSpec:
    """One StepBatch leaf: in which buffer, where, and what it is."""

    buffer: str  # _WORDS, _FLAGS or _HELD
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # into its buffer
    size: int  # elements


@dataclass(frozen=True, eq=False)  # compared by identity: one per bucket and layout (`batch_packing`)
class BatchPacking:
    """Where each leaf of a bucket's StepBatch sits: a static part of the step's inputs."""

    treedef: Any  # of StepBatch
    leaves: tuple[_LeafSpec, ...]  # in tree order
    num_words: int
    num_flags: int


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PackedBatch:
    """A StepBatch as the step receives it (`pack`, `unpack`)."""

    words: jax.Array  # i32[W]: the batch's 4-byte narrow arrays end to end
    flags: jax.Array  # bool[F]: its boolean arrays end to end
    held: tuple[jax.Array, ...]  # the inputs sent whole, in tree order
    packing: BatchPacking = field(metadata=dict(static=True))


_packings: dict[tuple[Bucket, "BatchLayout"], BatchPacking] = {}
_packings_lock = threading.Lock()  # the engine thread and a background warm-up's compile threads ask at once


def batch_packing(bucket: Bucket, layout: "BatchLayout") -> BatchPacking:
    """The bucket's packing: one object per bucket and layout for the process's life, since a compiled step
    accepts only the very packing it was compiled with."""
    key = (bucket, layout)
    packing = _packings.get(key)
    if packing is None:
        with _packings_lock:
            packing = _packings.setdefault(key, _new_packing(bucket, layout))
    return packing


def _new_packing(bucket: Bucket, layout: "BatchLayout") -> BatchPacking:
    template = _separate_neutral_batch(bucket, layout)
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    specs, sizes = [], {_WORDS: 0, _FLAGS: 0, _HELD: 0}
    for path, leaf in paths_and_leaves:
        name = path[-1].name
        buffer = _HELD if name in _HELD_WHOLE else _FLAGS if leaf.dtype == np.bool_ else _WORDS
        if buffer == _WORDS and leaf.dtype.itemsize != 4:
            raise TypeError(f"StepBatch.{name}: {leaf.dtype} is neither 4 bytes wide nor boolean")
        specs.append(_LeafSpec(buffer, leaf.dtype, leaf.shape, sizes[buffer], leaf.size))
        sizes[buffer] += leaf.size if buffer != _HELD else 1
    return BatchPacking(treedef, tuple(specs), sizes[_WORDS], sizes[_FLAGS])


def pack(batch: "StepBatch", bucket: Bucket, layout: "BatchLayout") -> PackedBatch:
    """The bucket's batch as the step takes it: its two buffers and its whole inputs. A batch from
    `neutral_batch` is packed already: its narrow arrays are views of the buffers, written in place (never
    replaced by other views of them). Any other batch (unpickled, or with an array replaced) is copied into
    new buffers."""
    packing = batch_packing(bucket, layout)
    leaves = jax.tree.leaves(batch)
    buffers: dict[str, np.ndarray | None] = {_WORDS: None, _FLAGS: None}
    held = []
    for spec, leaf in zip(packing.leaves, leaves, strict=True):
        if spec.buffer == _HELD:
            held.append(leaf)
            continue
        if buffers[spec.buffer] is None:
            buffers[spec.buffer] = leaf.base
        if leaf.base is None or leaf.base is not buffers[spec.buffer]:
            return _copy_packed(leaves, packing)
    words, flags = buffers[_WORDS], buffers[_FLAGS]
    if words.size != packing.num_words or flags.size != packing.num_flags:
        return _copy_packed(leaves, packing)
    return PackedBatch(words, flags, tuple(held), packing)


def _copy_packed(leaves: list[np.ndarray], packing: BatchPacking) -> PackedBatch:
    words, flags, held = [], [], []
    for spec, leaf in zip(packing.leaves, leaves, strict=True):
        if spec.buffer == _HELD:
            held.append(leaf)
            continue
        if leaf.dtype != spec.dtype or leaf.shape != spec.shape:
            raise TypeError(f"a batch array is {leaf.dtype}{list(leaf.shape)}, not {spec.dtype}{list(spec.shape)}")
        if spec.buffer == _WORDS:
            words.append(np.ravel(leaf).view(np.int32))  # by their bits: concatenating would convert them
        else:
            flags.append(np.ravel(leaf))
    return PackedBatch(np.concatenate(words), np.concatenate(flags), tuple(held), packing)


def unpack(packed: PackedBatch) -> "StepBatch":
    """Inside the step: the StepBatch again, its narrow arrays as static slices of the buffers."""
    held = iter(packed.held)
    leaves = []
    for spec in packed.packing.leaves:
        if spec.buffer == _HELD:
            leaves.append(next(held))
            continue
        end = spec.offset + spec.size
        if spec.buffer == _FLAGS:
            leaves.append(packed.flags[spec.offset : end].reshape(spec.shape))
            continue
        x = packed.words[spec.offset : end]
        if spec.dtype != np.int32:
            x = jax.lax.bitcast_convert_type(x, jnp.dtype(spec.dtype))
        leaves.append(x.reshape(spec.shape))
    return jax.tree.unflatten(packed.packing.treedef, leaves)


def banned_and_biased(item: ScheduledRequest) -> dict[int, float]:
    """token id -> bias for this step: the request's logit_bias, and -inf on the ids it may not sample
    (min_tokens' bans, decided by the engine)."""
    bias = dict(item.sampling_params.logit_bias)
    bias.update(dict.fromkeys(item.banned_token_ids, -np.inf))
    return bias


_masks = MaskFiller()


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


def build_step_batch(
    scheduler_output: SchedulerOutput,
    bucket: Bucket,
    layout: BatchLayout,
    rows: RequestRows,
    row_ids: np.ndarray,  # intp[n]: each scheduled request's row in `rows`, in the step's row order
) -> StepBatch:
    """The step's arrays: the requests' persistent rows gathered, the step's own columns filled for all rows
    at once (the plain decodes straight from the scheduler's columns), and only rows using rare features
    (penalties, biases, bans, prompt logprobs, a grammar) filled one by one (a Python loop over every row
    costs 20 us a row, 5 ms a step at 256 decodes). A value that cannot go in its column (one request's bad
    data) raises RequestFault for that request: the rows are filled again one at a time to find it."""
    scheduled, decodes = scheduler_output.scheduled, scheduler_output.decodes
    batch = neutral_batch(bucket, layout)
    try:
        biases = _fill_rows(batch, scheduled, decodes, rows, row_ids, layout)
    except Exception as error:
        singles = [((item,), NO_DECODES, item.request_id) for item in scheduled]  # in row order
        singles += [((), DecodeColumns([request_id], [token], [position], [output]), request_id)
                    for request_id, token, position, output in zip(*decodes, strict=True)]
        for index, (records, columns, request_id) in enumerate(singles):
            try:
                _fill_rows(neutral_batch(bucket, layout), records, columns, rows, row_ids[index : index + 1], layout)
            except Exception as e:  # one request's values must not fail the whole step
                raise RequestFault(request_id) from e
        raise error
    # A sample is constrained only when kept (the scheduler sets `grammar` then; a prefill chunk's is dropped).
    grammar_rows = [(item.grammar, row) for row, item in enumerate(scheduled) if item.grammar is not None]
    if not biases and not grammar_rows:
        return batch
    sampling = batch.sampling
    bias_token_ids, bias_values, token_bitmask = sampling.bias_token_ids, sampling.bias_values, sampling.token_bitmask
    if biases:
        bias_token_ids, bias_values = bias_token_ids.copy(), bias_values.copy()
        for row, token_ids, values in biases:
            bias_token_ids[row, : len(token_ids)] = token_ids
            bias_values[row, : len(values)] = values
    if grammar_rows:
        token_bitmask = token_bitmask.copy()
        _masks.fill(grammar_rows, token_bitmask)  # after reading the last step's tokens, before this one runs
        sampling.constrained[[row for _, row in grammar_rows]] = True
    sampling = dataclasses.replace(sampling, bias_token_ids=bias_token_ids, bias_values=bias_values,
                                   token_bitmask=token_bitmask)
    return dataclasses.replace(batch, sampling=sampling)


def neutral_batch(bucket: Bucket, layout: BatchLayout) -> StepBatch:
    """A batch of padding: no tokens, no requests, every feature switched off (numpy). Its narrow arrays
    are views of two fresh buffers (`pack`), written in place by the builder; the wide ones are shared
    and copied before a write."""
    packing = batch_packing(bucket, layout)
    words, flags, held = _neutral_buffers(bucket, layout)
    words, flags, held = words.copy(), flags.copy(), iter(held)
    leaves = []
    for spec in packing.leaves:
        if spec.buffer == _HELD:
            leaves.append(next(held))
        else:
            buffer = words if spec.buffer == _WORDS else flags
            leaves.append(buffer[spec.offset : spec.offset + spec.size].view(spec.dtype).reshape(spec.shape))
    return jax.tree.unflatten(packing.treedef, leaves)


@functools.cache
def _neutral_buffers(bucket: Bucket, layout: BatchLayout) -> tuple[np.ndarray, np.ndarray, tuple]:
    """The neutral batch's two buffers and whole inputs, read-only: each batch starts from copies."""
    packed = _copy_packed(jax.tree.leaves(_separate_neutral_batch(bucket, layout)), batch_packing(bucket, layout))
    for array in (packed.words, packed.flags, *packed.held):
        array.flags.writeable = False
    return packed.words, packed.flags, packed.held


def _separate_neutral_batch(bucket: Bucket, layout: BatchLayout) -> StepBatch:
    """The neutral batch's values, each array on its own (the template `batch_packing` lays out)."""
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
            temperature=np.zeros(num_reqs, np.float32),
            top_k=np.zeros(num_reqs, np.int32),
            top_p=np.ones(num_reqs, np.float32),
            min_p=np.zeros(num_reqs, np.float32),
            seeds=np.zeros(num_reqs, np.uint32),
            output_index=np.zeros(num_reqs, np.int32),
            bias_token_ids=bias_token_ids,
            bias_values=bias_values,
            penalty_slots=np.full(num_reqs, no_slot, np.int32),
            repetition_penalty=np.ones(num_reqs, np.float32),
            frequency_penalty=np.zeros(num_reqs, np.float32),
            presence_penalty=np.zeros(num_reqs, np.float32),
            wants_logprobs=np.zeros(num_reqs, np.bool_),
            wants_top_logprobs=np.zeros(num_reqs, np.bool_),
            token_bitmask=token_bitmask,
            constrained=np.zeros(num_reqs, np.bool_),
        ),
        penalty_updates=PenaltyUpdates(
            reset_slots=np.full(num_reqs, no_slot, np.int32),
            prompt_token_slots=np.full(num_tokens, no_slot, np.int32),
            output_token_slots=np.full(num_tokens, no_slot, np.int32),
        ),
        prompt_logprob_targets=np.full(num_tokens, layout.vocab_size, np.int32),
    )


def _fill_rows(
    batch: StepBatch,
    scheduled: tuple[ScheduledRequest, ...],
    decodes: DecodeColumns,
    rows: RequestRows,
    row_ids: np.ndarray,
    layout: BatchLayout,
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Writes `scheduled`, then `decodes`, into rows 0.. of a neutral batch; returns the biased rows as (row,
    token ids i32[k], biases f32[k]), written afterwards into copies of the shared bias arrays."""
    num_records, num_decodes = len(scheduled), len(decodes.request_ids)
    num_rows = num_records + num_decodes
    if not num_rows:
        return []
    attention, sampling, penalties = batch.attention, batch.sampling, batch.penalty_updates
    lengths = np.ones(num_rows, np.int64)  # [n]: a decode computes one token
    lengths[:num_records] = np.fromiter((len(item.token_ids) for item in scheduled), np.int64, num_records)
    cu_lens = np.zeros(num_rows + 1, np.int64)  # [n + 1]
    np.cumsum(lengths, out=cu_lens[1:])
    total = int(cu_lens[-1])
    row_of_token = np.repeat(np.arange(num_rows), lengths)  # [total]
    starts = np.empty(num_rows, np.int64)  # [n]
    starts[:num_records] = np.fromiter((item.start_position for item in scheduled), np.int64, num_records)
    starts[num_records:] = decodes.positions
    positions = starts[row_of_token] + np.arange(total) - cu_lens[row_of_token]  # [total]

    num_record_tokens = total - num_decodes
    token_ids = np.empty(total, np.int64)  # [total]
    token_ids[:num_record_tokens] = np.fromiter(itertools.chain.from_iterable(item.token_ids for item in scheduled),
                                                np.int64, num_record_tokens)
    token_ids[num_record_tokens:] = decodes.token_ids
    pending = token_ids == PENDING_TOKEN  # sampled by the previous step, still on the device
    batch.input_ids[:total] = np.where(pending, 0, token_ids)
    if pending.any():  # async scheduling: each takes its sample from the row it had in the previous step
        batch.input_from_row[:total][pending] = rows.in_flight_sample_rows(row_ids[row_of_token[pending]])
    batch.positions[:total] = positions

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
    sampling.output_index[:num_records] = [item.num_output_tokens for item in scheduled]
    sampling.output_index[num_records:num_rows] = decodes.output_indices

    # Features few requests use: row by row, only for the rows that use them (records: a request using one
    # never decodes as a column, `Request.has_plain_decodes`).
    biases = []
    no_slot = layout.num_penalty_slots
    for row in np.flatnonzero(rows.row_features[row_ids[:num_records]]).tolist():
        item = scheduled[row]
        first, end = cu_lens[row], cu_lens[row + 1]
        slot = int(sampling.penalty_slots[row])
        if slot != no_slot:
            if item.start_position == 0:  # new or recomputed: the step clears its penalty row
                penalties.reset_slots[row] = slot
            is_prompt = positions[first:end] < item.num_prompt_tokens
            penalties.prompt_token_slots[first:end] = np.where(is_prompt, slot, no_slot)
            penalties.output_token_slots[first:end] = np.where(is_prompt, no_slot, slot)
        if item.prompt_logprob_targets:  # position p scores prompt token p + 1
            batch.prompt_logprob_targets[first : first + len(item.prompt_logprob_targets)] = item.prompt_logprob_targets
        if item.sampling_params.logit_bias or item.banned_token_ids:
            bias = banned_and_biased(item)
            if len(bias) > MAX_BIASED_TOKENS:
                raise ValueError(f"{len(bias)} biased tokens, at most {MAX_BIASED_TOKENS}")
            biases.append((row, np.array(list(bias), np.int32), np.array(list(bias.values()), np.float32)))
    return biases
