"""Pages outside a sliding window: a model whose every layer has one releases the pages that only hold keys
before its next query's window, so a request's pages stay bounded by the window, not its length. Pure
Python, no model (the attention paths' side, never reading those pages: tests/ops/test_sliding_window.py)."""

import pytest

from jaxserve.engine.kv_cache_manager import SCRATCH_PAGE, KVCacheManager, shared_window
from jaxserve.engine.scheduler import Scheduler
from tests.engine.test_prefix_cache import make_request as prefix_request
from tests.engine.test_scheduler import make_request, run_step

PAGE = 4


def test_the_shared_window_is_every_layers_or_none():
    assert shared_window(()) is None
    assert shared_window((7, 7)) == 7
    assert shared_window((4096, None, 4096)) is None, "a global layer needs every key"
    assert shared_window((512, 1024)) == 1024


@pytest.mark.parametrize("window", [1, 4, 5, 9])
def test_release_drops_the_pages_wholly_before_the_window(window):
    kv = KVCacheManager(num_pages=12, page_size=PAGE, sliding_window=window)
    pages: list[int] = []
    assert kv.allocate(pages, 30)
    held = list(pages)
    first_query = 25  # sees keys from 25 - window + 1
    released = kv.release_outside_window(pages, first_query)
    expected = (first_query - window + 1) // PAGE
    assert released == expected
    assert pages[:expected] == [SCRATCH_PAGE] * expected and pages[expected:] == held[expected:]
    assert kv.num_free_pages == 11 - len(held) + expected
    assert all(kv.ref_count(page) == 0 for page in held[:expected])
    assert kv.release_outside_window(pages, first_query) == 0, "released once"
    kv.free(pages)
    assert kv.num_free_pages == 11 and kv.ref_count(SCRATCH_PAGE) == 0


def test_no_window_releases_nothing():
    kv = KVCacheManager(num_pages=12, page_size=PAGE)
    pages: list[int] = []
    kv.allocate(pages, 30)
    assert kv.release_outside_window(pages, 29) == 0 and SCRATCH_PAGE not in pages


def test_a_request_holds_only_its_window_while_it_grows():
    """50 tokens fill 13 pages of 4; under a 6-token window the request never holds more than the window's
    pages and the one being filled, and gives every page back at the end. (A request must still fit the
    whole pool to be admitted: the check stays the conservative one.)"""
    kv = KVCacheManager(num_pages=14, page_size=PAGE, sliding_window=6)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=8)
    sched.add_request(make_request("a", 10, max_tokens=40))
    most_held = 0
    for _ in range(60):
        if not sched.has_unfinished():
            break
        out = run_step(sched)
        assert not out.preempted_ids
        request = sched.requests.get("a")
        if request is not None:
            held = [page for page in request.page_ids if page != SCRATCH_PAGE]
            most_held = max(most_held, len(held))
            first_live = max(0, request.num_computed_tokens - 6) // PAGE  # keys the next query can see
            assert SCRATCH_PAGE not in request.page_ids[first_live:]
    assert not sched.has_unfinished()
    assert most_held <= 4
    assert kv.num_free_pages == 13


def test_released_pages_stay_cached_for_a_later_prefix_hit():
    """Released full pages keep their prefix-cache keys; a second request with the same prompt hits them
    (and releases those before its own window at once)."""
    kv = KVCacheManager(num_pages=32, page_size=PAGE, sliding_window=5)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64)
    prompt = list(range(100, 124))  # 6 full pages
    sched.add_request(prefix_request("a", prompt, max_tokens=6))
    while sched.has_unfinished():
        run_step(sched)
    assert kv.num_cached_pages >= 6
    sched.add_request(prefix_request("b", prompt, max_tokens=2))
    out = run_step(sched)
    request = sched.requests["b"]
    assert request.num_cached_tokens == 20, "all full pages but the last, recomputed for its logits"
    assert out.start_positions == [20]
    assert request.page_ids[:4] == [SCRATCH_PAGE] * 4, "pages before the window, released at once"
