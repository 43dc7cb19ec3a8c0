"""Bucket ladders: picking, warm-up coverage, cuts at the limits (no jax)."""

import pytest

from jaxserve.runner.buckets import Bucket, BucketLadder


def test_pick_rounds_up_and_decode_steps_use_square_buckets():
    ladder = BucketLadder((32, 64, 128), (1, 2, 4, 8), max_num_batched_tokens=128, max_num_seqs=8)
    assert ladder.pick(num_tokens=1, num_reqs=1) == Bucket(1, 1, decode_only=True)
    assert ladder.pick(num_tokens=3, num_reqs=3) == Bucket(4, 4, decode_only=True)
    assert ladder.pick(num_tokens=40, num_reqs=3) == Bucket(64, 4)
    assert ladder.pick(num_tokens=128, num_reqs=8) == Bucket(128, 8)
    with pytest.raises(ValueError):
        ladder.pick(num_tokens=129, num_reqs=1)


def test_a_mixed_step_in_a_square_bucket_is_not_decode_only():
    ladder = BucketLadder((32, 64), (1, 8, 32), max_num_batched_tokens=64, max_num_seqs=32)
    assert ladder.pick(num_tokens=32, num_reqs=20) == Bucket(32, 32, decode_only=False)
    assert ladder.pick(num_tokens=20, num_reqs=20) == Bucket(32, 32, decode_only=True)
    assert {Bucket(32, 32, False), Bucket(32, 32, True)} <= set(ladder.all_buckets())


def test_every_pickable_bucket_is_warmed_up():
    ladder = BucketLadder((16, 64), (1, 4, 32), max_num_batched_tokens=64, max_num_seqs=32)
    warm = set(ladder.all_buckets())
    for num_reqs in range(1, 33):
        for num_tokens in range(num_reqs, 65):
            assert ladder.pick(num_tokens, num_reqs) in warm


def test_ladders_are_cut_at_the_limits():
    ladder = BucketLadder((32, 64, 128, 256), (1, 2, 4, 8, 16), max_num_batched_tokens=100, max_num_seqs=6)
    assert ladder.token_buckets == (32, 64, 100)
    assert ladder.request_buckets == (1, 2, 4, 6)

