"""build_step_batch: the plain decode columns give the batch their records would."""

import numpy as np
import pytest

from jaxserve.engine.request import RequestFault
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
PAGES = {"a": (5, 10), "b": (6, 7), "c": (8,)}


def record(request_id: str, token_ids: tuple[int, ...], start: int, first_new_page: int,
           new_page_ids: tuple[int, ...], num_output_tokens: int, resumed: bool = False) -> ScheduledRequest:
    return ScheduledRequest(request_id, token_ids, start, first_new_page, new_page_ids, resumed, True,
                            PARAMS[request_id], ord(request_id), len(PROMPTS[request_id]), num_output_tokens)


def launch(rows: RequestRows, out: SchedulerOutput):
    row_ids = rows.update(out.scheduled, out.decodes.request_ids)
    batch = build_step_batch(out, BUCKET, LAYOUT, rows, row_ids)
    rows.launched(row_ids, np.ones(len(row_ids), np.bool_))
    return row_ids, batch


def test_plain_decode_columns_build_the_batch_their_records_would():
    rows = RequestRows(num_rows=4, max_pages_per_req=3)
    launch(rows, SchedulerOutput(tuple(record(r, PROMPTS[r], 0, 0, PAGES[r], 0, resumed=True) for r in "cab"), ()))
    assert [rows.row_of[r] for r in "cab"] == [0, 1, 2]
    launch(rows, SchedulerOutput((), (), decodes=DecodeColumns(["a", "b"], [20, 30], [3, 5], [1, 1])))
    # b sampled in batch row 1 of that step, and holds persistent row 2.

    # c's decode needs a new page: a record. a's token is known (synchronous); b's is in flight (async).
    c_decode = record("c", (13,), 4, 1, (9,), 1)
    decodes = DecodeColumns(["a", "b"], [21, PENDING_TOKEN], [4, 6], [2, 2])
    as_columns = SchedulerOutput((c_decode,), (), decodes=decodes)
    as_records = SchedulerOutput(
        (c_decode, record("a", (21,), 4, 2, (), 2), record("b", (PENDING_TOKEN,), 6, 2, (), 2)), ())
    column_rows = rows.update(as_columns.scheduled, decodes.request_ids)
    record_rows = rows.update(as_records.scheduled)
    assert column_rows.tolist() == record_rows.tolist() == [0, 1, 2]
    from_columns = build_step_batch(as_columns, BUCKET, LAYOUT, rows, column_rows)
    from_records = build_step_batch(as_records, BUCKET, LAYOUT, rows, record_rows)
    leaves_equal(from_columns, from_records)
    # And what they are: c's new page, a's known token, b's token taken from its row of the previous step.
    assert from_columns.input_ids[:3].tolist() == [13, 21, 0]
    assert from_columns.input_from_row[:3].tolist() == [LAYOUT.max_num_seqs, LAYOUT.max_num_seqs, 1]
    assert from_columns.positions[:3].tolist() == [4, 4, 6]
    assert from_columns.attention.slot_mapping[:3].tolist() == [9 * 4 + 0, 10 * 4 + 0, 7 * 4 + 2]
    assert from_columns.sampling.temperature[:3].tolist() == [0.0, 0.5, 1.0]
    assert from_columns.sampling.output_index[:3].tolist() == [1, 2, 2]
    assert from_columns.penalty_updates.output_token_slots[0] == column_rows[0], "c's row fills its penalties"


def test_a_token_in_flight_from_a_step_that_did_not_sample_it_fails_its_request():
    rows = RequestRows(num_rows=4, max_pages_per_req=3)
    launch(rows, SchedulerOutput(tuple(record(r, PROMPTS[r], 0, 0, PAGES[r], 0, resumed=True) for r in "ab"), ()))
    launch(rows, SchedulerOutput((), (), decodes=DecodeColumns(["a"], [20], [3], [1])))  # b did not run
    out = SchedulerOutput((), (), decodes=DecodeColumns(["a", "b"], [PENDING_TOKEN, PENDING_TOKEN], [4, 5], [2, 1]))
    with pytest.raises(RequestFault) as fault:
        build_step_batch(out, BUCKET, LAYOUT, rows, rows.update((), out.decodes.request_ids))
    assert fault.value.request_id == "b"
