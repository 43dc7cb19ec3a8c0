"""The runner's persistent batch (RequestRows): pure numpy, no model."""

import numpy as np
import pytest

from jaxserve.engine.step_io import RequestFault
from jaxserve.runner.request_rows import RequestRows
from tests.runner.helpers import new_request as new


def test_rows_keep_pages_and_parameters_across_steps():
    rows = RequestRows(num_rows=4, max_pages_per_req=6, vocab_size=40)
    a, b = rows.update((new("a", temperature=0.5, top_k=7), new("b", repetition_penalty=1.2)), ["a", "b"],
                       {0: (0, (3, 4)), 1: (0, (9,))}).tolist()
    assert a != b
    assert rows.temperature[a] == np.float32(0.5) and rows.top_k[a] == 7
    assert rows.penalty_slots[a] == 4 and rows.penalty_slots[b] == b, "a row with penalties is its own slot"
    assert rows.row_features[b] and not rows.row_features[a]
    assert rows.update((), ["b", "a"], {0: (1, (11,))}).tolist() == [b, a]  # b grew a page; a did not
    assert rows.page_table[a, :3].tolist() == [3, 4, 0] and rows.page_table[b, :3].tolist() == [9, 11, 0]
    rows.update((), ["b"], {0: (1, (11,))})  # sent again after a step taken back: the same place
    assert rows.page_table[b, :3].tolist() == [9, 11, 0]


def test_a_greedy_request_s_row_holds_the_greedy_temperature():
    rows = RequestRows(num_rows=2, max_pages_per_req=2, vocab_size=40)
    (row,) = rows.update((new("g", temperature=1e-6),), ["g"], {0: (0, (1,))})
    assert rows.temperature[row] == 0.0, "below the greedy threshold: the row says greedy exactly"


def test_a_resumed_request_is_written_afresh_and_released_rows_are_reused():
    rows = RequestRows(num_rows=2, max_pages_per_req=4, vocab_size=40)
    (a,) = rows.update((new("a", temperature=0.3),), ["a"], {0: (0, (1, 2, 3))})
    (again,) = rows.update((new("a"),), ["a"], {0: (0, (7,))})  # back from preemption: fewer pages
    assert again == a
    assert rows.page_table[a].tolist() == [7, 0, 0, 0] and rows.temperature[a] == 1.0  # the default
    rows.release(["a", "never-scheduled"])
    assert rows.num_used == 0
    rows.update((new("b"), new("c")), ["b", "c"], {0: (0, (5,)), 1: (0, (6,))})
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        rows.update((new("d"),), ["d"], {0: (0, (8,))})


def test_a_value_out_of_its_column_fails_its_request_alone():
    rows = RequestRows(num_rows=4, max_pages_per_req=4, vocab_size=40)
    hit = new("hit", repetition_penalty=1.3, cached_token_ids=(10, 11, 12, 13))  # after a prefix-cache hit
    with pytest.raises(RequestFault) as info:
        rows.update((hit, new("bad", seed=2**40)), ["hit", "bad"], {0: (1, (1,)), 1: (0, (2,))})
    assert info.value.request_id == "bad" and "bad" not in rows.row_of
    # The step is planned again without "bad": "hit" comes as a running request, and its row is there
    # with the cached tokens its penalties count.
    assert rows.take_seen_tokens() == [(rows.row_of["hit"], (10, 11, 12, 13), 1)]
    assert rows.take_seen_tokens() == []
    (row,) = rows.update((), ["hit"], {0: (0, (1,))})
    assert row == rows.row_of["hit"] and rows.page_table[row, 0] == 1


def test_a_running_request_without_a_row_fails_alone():
    rows = RequestRows(num_rows=2, max_pages_per_req=2, vocab_size=40)
    with pytest.raises(RequestFault) as info:
        rows.update((), ["ghost"], {})
    assert info.value.request_id == "ghost"


def test_pages_past_a_row_fail_their_request():
    rows = RequestRows(num_rows=2, max_pages_per_req=2, vocab_size=40)
    with pytest.raises(RequestFault) as info:
        rows.update((new("long"),), ["long"], {0: (0, (1, 2, 3))})
    assert info.value.request_id == "long"
