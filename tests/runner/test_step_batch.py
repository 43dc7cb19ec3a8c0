"""build_step_batch: a plan's columns and sparse rows, with the persistent rows, become the step's arrays."""

import dataclasses

import numpy as np
import pytest

from jaxserve.engine.step_io import PENDING_TOKEN, RequestFault, SchedulerOutput, token_bitmask
from jaxserve.engine.structured_output import allowed_tokens
from jaxserve.runner.batch import build_step_batch
from jaxserve.runner.buckets import Bucket
from jaxserve.runner.request_rows import RequestRows
from jaxserve.runner.step_batch import BatchLayout
from tests.engine.sent_pages import Row, plan
from tests.runner.helpers import new_request

LAYOUT = BatchLayout(page_size=4, max_pages_per_req=3, padding_slot=99, vocab_size=40, num_penalty_slots=4,
                     max_num_seqs=4)
BUCKET = Bucket(16, 4, False)
PARAMS = {"a": dict(temperature=0.5, top_k=3, logprobs=0), "b": dict(top_p=0.5, min_p=0.25),
          "c": dict(temperature=0.0, repetition_penalty=1.5)}
PROMPTS = {"a": (1, 2, 3), "b": (4, 5, 6, 7, 8), "c": (9, 10, 11, 12)}
PAGES = {"a": (5, 10), "b": (6, 7), "c": (8,)}


def row(request_id: str, token_ids: tuple[int, ...], start: int, num_output_tokens: int,
        first_new_page: int | None = None, new_page_ids: tuple[int, ...] = (), resumed: bool = False) -> Row:
    new = new_request(request_id, ord(request_id), len(PROMPTS[request_id]), **PARAMS[request_id]) if resumed else None
    return Row(request_id, token_ids, start, num_output_tokens, True, first_new_page, new_page_ids, (), (), new)


def launch(rows: RequestRows, out: SchedulerOutput, layout: BatchLayout = LAYOUT):
    row_ids = rows.update(out.new_requests, out.request_ids, out.new_pages)
    batch = build_step_batch(out, BUCKET, layout, rows, row_ids)
    rows.launched(row_ids, np.array(out.keeps_sample, np.bool_))
    return row_ids, batch


def prefills(names: str) -> SchedulerOutput:
    return plan([row(r, PROMPTS[r], 0, 0, 0, PAGES[r], resumed=True) for r in names])


def test_a_plan_s_rows_fill_the_batch():
    rows = RequestRows(num_rows=4, max_pages_per_req=3, vocab_size=LAYOUT.vocab_size)
    launch(rows, prefills("cab"))
    assert [rows.row_of[r] for r in "cab"] == [0, 1, 2]
    launch(rows, plan([row("a", (20,), 3, 1), row("b", (30,), 5, 1)]))
    # b sampled in batch row 1 of that step, and holds persistent row 2.

    # c's decode needs a new page; a's token is known (synchronous); b's is in flight (async).
    out = plan([row("c", (13,), 4, 1, 1, (9,)), row("a", (21,), 4, 2), row("b", (PENDING_TOKEN,), 6, 2)])
    row_ids, batch = launch(rows, out)
    assert row_ids.tolist() == [0, 1, 2]
    assert batch.input_ids[:3].tolist() == [13, 21, 0]
    assert batch.input_from_row[:3].tolist() == [LAYOUT.max_num_seqs, LAYOUT.max_num_seqs, 1]
    assert batch.positions[:3].tolist() == [4, 4, 6]
    assert batch.attention.slot_mapping[:3].tolist() == [9 * 4 + 0, 10 * 4 + 0, 7 * 4 + 2]
    assert batch.attention.kv_lens[:4].tolist() == [5, 5, 7, 0]
    assert batch.attention.cu_q_lens.tolist() == [0, 1, 2, 3, 3]
    assert batch.sampling.temperature[:3].tolist() == [0.0, 0.5, 1.0]
    assert batch.sampling.top_k[:3].tolist() == [0, 3, 0] and batch.sampling.seeds[:3].tolist() == [99, 97, 98]
    assert batch.sampling.output_index[:3].tolist() == [1, 2, 2]
    assert batch.penalty_updates.output_token_slots[0] == row_ids[0], "c's row fills its penalties"
    assert batch.penalty_updates.output_token_slots[1] == LAYOUT.num_penalty_slots, "a has none"


def test_a_speculative_plan_s_draft_rows_carry_the_drafts_before_them_for_their_penalties():
    """c (penalties) verifies drafts 17 and 18 on the two rows after its first: the first row's input is
    counted when the step starts, as a decode's; the drafts are not (the step counts the accepted ones once
    sampled), and each draft's row carries the drafts before it. a, without penalties, carries none."""
    layout = dataclasses.replace(LAYOUT, max_drafts=3)
    rows = RequestRows(num_rows=4, max_pages_per_req=3, vocab_size=layout.vocab_size)
    launch(rows, prefills("ca"), layout)
    out = plan([row("a", (20,), 3, 1), row("c", (13,), 4, 1, 1, (9,)), row("c", (17,), 5, 2), row("c", (18,), 6, 3)])
    row_ids, batch = launch(rows, dataclasses.replace(out, draft_lengths=(0, 2)), layout)
    slot_c, none, pad = row_ids[1], layout.num_penalty_slots, layout.vocab_size
    assert batch.sampling.penalty_slots[:4].tolist() == [none, slot_c, slot_c, slot_c]
    assert batch.penalty_updates.output_token_slots[:4].tolist() == [none, slot_c, none, none]
    assert batch.sampling.penalty_drafts[:4].tolist() == [[pad] * 3, [pad] * 3, [17, pad, pad], [17, 18, pad]]
    assert batch.positions[:4].tolist() == [3, 4, 5, 6]


def test_bans_biases_prompt_targets_and_grammar_masks_reach_only_their_rows():
    rows = RequestRows(num_rows=4, max_pages_per_req=3, vocab_size=LAYOUT.vocab_size)
    a = row("a", PROMPTS["a"], 0, 0, 0, PAGES["a"], resumed=True)
    biased = a.new._replace(logit_bias=((3, -1.5),), fills_row=True)
    out = plan([a._replace(new=biased, banned_token_ids=(2,), prompt_logprob_targets=(2, 3)),
                row("b", PROMPTS["b"], 0, 0, 0, PAGES["b"], resumed=True)])
    mask = np.zeros((1, 2), np.int32)
    mask[0, 0] = 1 << 7  # token 7 alone
    out = SchedulerOutput(**{**out.__dict__, "grammar_rows": (1,), "grammar_bitmask": mask})
    _, batch = launch(rows, out)
    sampling = batch.sampling
    assert sampling.bias_token_ids[0, :2].tolist() == [3, 2] and sampling.bias_values[0, :2].tolist() == [-1.5, -np.inf]
    assert (sampling.bias_token_ids[1] == LAYOUT.vocab_size).all(), "b is not biased"
    assert batch.prompt_logprob_targets[:4].tolist() == [2, 3, LAYOUT.vocab_size, LAYOUT.vocab_size]
    assert sampling.constrained[:2].tolist() == [False, True] and sampling.token_bitmask[1].tolist() == [1 << 7, 0]
    assert (sampling.token_bitmask[0] == -1).all(), "an unconstrained row allows every token"


def test_allowed_token_ids_mask_their_row_alone_and_within_a_grammar_s_mask():
    rows = RequestRows(num_rows=4, max_pages_per_req=3, vocab_size=LAYOUT.vocab_size)
    a, b, c = (row(r, PROMPTS[r], 0, 0, 0, PAGES[r], resumed=True) for r in "abc")
    a = a._replace(new=new_request("a", 1, 3, allowed_token_ids=[3, 7, 39]))
    b = b._replace(new=new_request("b", 2, 5, allowed_token_ids=[7, 12]))
    grammar = token_bitmask((7, 8), LAYOUT.vocab_size)[None]  # [1, W]: b's grammar allows 7 and 8
    out = plan([a, b, c])
    out = SchedulerOutput(**{**out.__dict__, "grammar_rows": (1,), "grammar_bitmask": grammar})
    _, batch = launch(rows, out)
    sampling = batch.sampling
    assert sampling.constrained[:3].tolist() == [True, True, False]
    assert allowed_tokens(sampling.token_bitmask[0], LAYOUT.vocab_size).tolist() == [3, 7, 39]
    assert allowed_tokens(sampling.token_bitmask[1], LAYOUT.vocab_size).tolist() == [7], "both masks hold"
    assert (sampling.token_bitmask[2] == -1).all()
    # the next step: a's mask is its row's, with no grammar (and no copy of the shared neutral masks' rows)
    _, batch = launch(rows, plan([row("a", (20,), 3, 1)]))
    assert batch.sampling.constrained[:2].tolist() == [True, False]
    assert allowed_tokens(batch.sampling.token_bitmask[0], LAYOUT.vocab_size).tolist() == [3, 7, 39]
    assert (batch.sampling.token_bitmask[1] == -1).all()
    with pytest.raises(RequestFault):  # an id past the mask (the engine's limits refuse it before)
        rows.update((new_request("d", allowed_token_ids=[LAYOUT.vocab_size]),), ["d"], {})


def test_a_token_in_flight_from_a_step_that_did_not_sample_it_fails_its_request():
    rows = RequestRows(num_rows=4, max_pages_per_req=3, vocab_size=LAYOUT.vocab_size)
    launch(rows, prefills("ab"))
    launch(rows, plan([row("a", (20,), 3, 1)]))  # b did not run
    out = plan([row("a", (PENDING_TOKEN,), 4, 2), row("b", (PENDING_TOKEN,), 5, 1)])
    with pytest.raises(RequestFault) as fault:
        build_step_batch(out, BUCKET, LAYOUT, rows, rows.update((), out.request_ids, {}))
    assert fault.value.request_id == "b"
