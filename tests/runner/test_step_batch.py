"""build_step_batch: the plain decode columns give the batch their records would."""

import numpy as np

from jaxserve.engine.scheduler import PENDING_TOKEN, DecodeColumns, ScheduledRequest, SchedulerOutput
from jaxserve.runner.batch import BatchLayout, build_step_batch
from jaxserve.runner.buckets import Bucket
from jaxserve.runner.request_rows import RequestRows
from jaxserve.sampling_params import SamplingParams
from tests.runner.test_batch_packing import leaves_equal

LAYOUT = BatchLayout(page_size=4, max_pages_per_req=3, padding_slot=99, vocab_size=40, num_penalty_slots=4,
                     max_num_seqs=4)
BUCKET = Bucket(16, 4, False)
PARAMS = {"a": SamplingParams(temperature=0.5, top_k=3, logprobs=0), "b": SamplingParams(top_p=0.5, min_p=0.25),
          "c": SamplingParams(temperature=0.0, repetition_penalty=1.5)}
PROMPTS = {"a": (1, 2, 3), "b": (4, 5, 6, 7, 8), "c": (9, 10, 11, 12)}
PAGES = {"a": (5,), "b": (6, 7), "c": (8,)}


def record(request_id: str, token_ids: tuple[int, ...], start: int, first_new_page: int,
           new_page_ids: tuple[int, ...], num_output_tokens: int, resumed: bool = False) -> ScheduledRequest:
    return ScheduledRequest(request_id, token_ids, start, first_new_page, new_page_ids, resumed, True,
                            PARAMS[request_id], ord(request_id), len(PROMPTS[request_id]), num_output_tokens)


def test_plain_decode_columns_build_the_batch_their_records_would():
    rows = RequestRows(num_rows=4, max_pages_per_req=3)
    prefill = SchedulerOutput(tuple(record(r, PROMPTS[r], 0, 0, PAGES[r], 0, resumed=True) for r in "bca"), ())
    row_ids = rows.update(prefill.scheduled)
    build_step_batch(prefill, BUCKET, LAYOUT, rows, row_ids)
    rows.launched(row_ids, np.ones(3, np.bool_))  # b, c, a sampled in batch rows 0, 1, 2

    # c's decode needs a new page: a record. a's token is known (synchronous); b's is in flight (async).
    c_decode = record("c", (13,), 4, 1, (9,), 1)
    decodes = DecodeColumns(["a", "b"], [21, PENDING_TOKEN], [3, 5], [1, 1])
    as_columns = SchedulerOutput((c_decode,), (), decodes=decodes)
    as_records = SchedulerOutput(
        (c_decode, record("a", (21,), 3, 1, (), 1), record("b", (PENDING_TOKEN,), 5, 2, (), 1)), ())
    column_rows = rows.update(as_columns.scheduled, decodes.request_ids)
    record_rows = rows.update(as_records.scheduled)
    assert column_rows.tolist() == record_rows.tolist()
    from_columns = build_step_batch(as_columns, BUCKET, LAYOUT, rows, column_rows)
    from_records = build_step_batch(as_records, BUCKET, LAYOUT, rows, record_rows)
    leaves_equal(from_columns, from_records)
    # And what they are: c's new page, a's known token, b's token taken from its row of the previous step.
    assert from_columns.input_ids[:3].tolist() == [13, 21, 0]
    assert from_columns.input_from_row[:3].tolist() == [LAYOUT.max_num_seqs, LAYOUT.max_num_seqs, 0]
    assert from_columns.positions[:3].tolist() == [4, 3, 5]
    assert from_columns.attention.slot_mapping[:3].tolist() == [9 * 4 + 0, 5 * 4 + 3, 7 * 4 + 1]
    assert from_columns.sampling.temperature[:3].tolist() == [0.0, 0.5, 1.0]
    assert from_columns.penalty_updates.output_token_slots[0] == column_rows[0], "c's row fills its penalties"
