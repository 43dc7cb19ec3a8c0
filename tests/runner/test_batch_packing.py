"""The step's packed inputs: a built batch's narrow arrays live in two buffers, and the step's unpacking
gives back every array, bit for bit, on the device."""

import dataclasses
import pickle

import jax
import numpy as np
import pytest

from jaxserve.runner.batch import build_step_batch
from jaxserve.runner.buckets import Bucket
from jaxserve.runner.packing import batch_packing, neutral_batch, pack, unpack
from jaxserve.runner.request_rows import RequestRows
from jaxserve.runner.step_batch import BatchLayout
from tests.engine.sent_pages import Row, plan
from tests.runner.helpers import leaves_equal, new_request

LAYOUT = BatchLayout(page_size=4, max_pages_per_req=3, padding_slot=99, vocab_size=40, num_penalty_slots=4,
                     max_num_seqs=4)
BUCKET = Bucket(8, 4, False)


def built_batch():
    """Two requests with features in every column kind: floats, uint32 seeds, booleans, biases, penalties."""
    rows = RequestRows(num_rows=4, max_pages_per_req=3, vocab_size=LAYOUT.vocab_size)
    a = new_request("a", 2**32 - 1, temperature=0.7, top_p=0.25, logprobs=2, logit_bias={3: -1.5})
    b = new_request("b", 0, 3, repetition_penalty=1.25, min_p=0.125)
    out = plan([Row("a", (5,), 0, 0, True, 0, (1, 2), (), (), a), Row("b", (7, 8, 9), 0, 0, True, 0, (5,), (), (), b)])
    row_ids = rows.update(out.new_requests, out.request_ids, out.new_pages)
    return build_step_batch(out, BUCKET, LAYOUT, rows, row_ids)


def test_a_built_batch_is_packed_without_a_copy():
    batch = built_batch()
    packing = batch_packing(BUCKET, LAYOUT)
    packed = pack(batch, BUCKET, LAYOUT)
    assert batch.sampling.temperature.base is packed.words and batch.sampling.wants_logprobs.base is packed.flags
    assert packed.words.size == packing.num_words and packed.flags.dtype == np.bool_
    assert len(packed.held) == 4  # previous tokens and the three wide sampling inputs
    assert neutral_batch(BUCKET, LAYOUT).input_ids.base is not batch.input_ids.base  # fresh buffers per step


def test_the_step_unpacks_every_array_bit_for_bit():
    batch = built_batch()
    assert batch.sampling.seeds[0] == 2**32 - 1 and batch.sampling.wants_logprobs[0]
    assert batch.penalty_updates.reset_slots[1] != LAYOUT.num_penalty_slots
    leaves_equal(jax.jit(unpack)(pack(batch, BUCKET, LAYOUT)), batch)
    # An unpickled batch (what a multi-host follower gets) has no shared buffers: it is copied into new ones.
    copied = pickle.loads(pickle.dumps(batch))
    assert copied.input_ids.base is not copied.positions.base or copied.input_ids.base is None
    leaves_equal(jax.jit(unpack)(pack(copied, BUCKET, LAYOUT)), batch)


def test_an_array_replaced_after_building_is_not_lost():
    batch = built_batch()
    replaced = dataclasses.replace(batch, positions=np.arange(BUCKET.num_tokens, dtype=np.int32))
    unpacked = jax.jit(unpack)(pack(replaced, BUCKET, LAYOUT))
    assert np.asarray(unpacked.positions).tolist() == list(range(BUCKET.num_tokens))
    wrong = dataclasses.replace(batch, positions=np.arange(BUCKET.num_tokens))  # int64: would be 2 words each
    with pytest.raises(TypeError, match="int64"):
        pack(wrong, BUCKET, LAYOUT)
