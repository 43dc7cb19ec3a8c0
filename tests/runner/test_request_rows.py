"""The runner's persistent batch (RequestRows): pure numpy, no model."""

import numpy as np
import pytest

from jaxserve.engine.request import RequestFault
from jaxserve.engine.scheduler import ScheduledRequest
from jaxserve.runner.request_rows import RequestRows
from jaxserve.sampling_params import SamplingParams


def item(request_id: str, first_new_page: int, new_page_ids: tuple[int, ...], resumed: bool = False,
         seed: int = 0, **params) -> ScheduledRequest:
    return ScheduledRequest(request_id, (5,), 0, first_new_page, new_page_ids, resumed, True,
                            SamplingParams(**params), seed, 1, 0)


def test_rows_keep_pages_and_parameters_across_steps():
    rows = RequestRows(num_rows=4, max_pages_per_req=6)
    a, b = rows.update((item("a", 0, (3, 4), resumed=True, temperature=0.5, top_k=7),
                        item("b", 0, (9,), resumed=True, repetition_penalty=1.2))).tolist()
    assert a != b
    assert rows.temperature[a] == np.float32(0.5) and rows.top_k[a] == 7
    assert rows.penalty_slots[a] == 4 and rows.penalty_slots[b] == b, "a row with penalties is its own slot"
    assert rows.row_features[b] and not rows.row_features[a]
    assert rows.update((item("b", 1, (11,)), item("a", 2, ()))).tolist() == [b, a]  # b grew a page; a did not
    assert rows.page_table[a, :3].tolist() == [3, 4, 0] and rows.page_table[b, :3].tolist() == [9, 11, 0]
    rows.update((item("b", 1, (11,)),))  # sent again after a step taken back: the same place
    assert rows.page_table[b, :3].tolist() == [9, 11, 0]


def test_a_resumed_request_is_written_afresh_and_released_rows_are_reused():
    rows = RequestRows(num_rows=2, max_pages_per_req=4)
    (a,) = rows.update((item("a", 0, (1, 2, 3), resumed=True, temperature=0.3),))
    (again,) = rows.update((item("a", 0, (7,), resumed=True),))  # back from preemption: fewer pages
    assert again == a
    assert rows.page_table[a].tolist() == [7, 0, 0, 0] and rows.temperature[a] == 1.0  # the default
    rows.release(["a", "never-scheduled"])
    assert rows.num_used == 0
    rows.update((item("b", 0, (5,), resumed=True), item("c", 0, (6,), resumed=True)))
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        rows.update((item("d", 0, (8,), resumed=True),))


def test_a_value_out_of_its_column_fails_its_request_alone():
    rows = RequestRows(num_rows=4, max_pages_per_req=4)
    hit = item("hit", 0, (1,), resumed=True, repetition_penalty=1.3)._replace(
        start_position=4, cached_token_ids=(10, 11, 12, 13))  # after a prefix-cache hit, with penalties
    with pytest.raises(RequestFault) as info:
        rows.update((hit, item("bad", 0, (2,), resumed=True, seed=2**40)))
    assert info.value.request_id == "bad" and "bad" not in rows.row_of
    # The step is planned again without "bad": "hit" comes as a running request, and its row is there
    # with the cached tokens its penalties count.
    assert rows.take_seen_tokens() == [(rows.row_of["hit"], (10, 11, 12, 13), 1)]
    assert rows.take_seen_tokens() == []
    (row,) = rows.update((hit._replace(resumed=False, cached_token_ids=None),))
    assert row == rows.row_of["hit"] and rows.page_table[row, 0] == 1


def test_pages_past_a_row_fail_their_request():
    rows = RequestRows(num_rows=2, max_pages_per_req=2)
    with pytest.raises(RequestFault) as info:
        rows.update((item("long", 0, (1, 2, 3), resumed=True),))
    assert info.value.request_id == "long"
