"""Prefix caching in the KV-page manager and the scheduler: pure Python, no model."""

import random

from jaxserve.engine.kv_cache_manager import KVCacheManager, extend_page_keys, page_key
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.step_io import SchedulerOutput, StepOutput
from jaxserve.sampling_params import SamplingParams
from tests.engine.sent_pages import SentPages, replay, rows, shares

PAGE = 4


def keys_of(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return extend_page_keys([], len(tokens) // PAGE, PAGE, lambda a, b: tokens[a:b], salt)


def make_request(request_id: str, prompt: list[int], max_tokens: int = 3, salt: str | None = None,
                 **params) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
                   eos_token_ids=(2,), max_model_len=1024, sampling_seed=0, cache_salt=salt)


def check_writes(kv: KVCacheManager, out: SchedulerOutput, sent: SentPages) -> None:
    """A step writes K/V only into pages its request holds alone and that carry no key."""
    writes = [(request_id, start, start + num_new) for request_id, start, num_new
              in zip(out.request_ids, out.start_positions, out.num_new_tokens, strict=True)]
    for request_id, start, end in writes:
        for page in {sent.of(request_id)[p // PAGE] for p in range(start, end)}:
            assert kv.ref_count(page) == 1, f"page {page} written while shared"
            assert not kv.is_cached(page), f"page {page} written while cached"


def run_step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    """One step, with the pages sent to the runner replayed (`SentPages`) and checked."""
    out = sched.schedule()
    check_writes(sched.kv_cache, out, replay(sched, out))
    ids = out.request_ids
    sched.update(out, StepOutput(ids, [token] * len(ids), [0.0] * len(ids)))
    return out


def drain(sched: Scheduler) -> None:
    while sched.has_unfinished():
        run_step(sched)


def assert_all_released(kv: KVCacheManager) -> None:
    assert all(kv.ref_count(p) == 0 for p in range(kv.num_pages))
    assert kv.num_free_pages == kv.num_usable_pages and kv.usage == 0.0


# Keys --------------------------------------------------------------------------------------------------

def test_same_prefix_same_keys_and_a_key_names_the_whole_prefix():
    a = keys_of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = keys_of([1, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2, "the partial third page has no key"
    assert a == b
    c = keys_of([0, 2, 3, 4, 5, 6, 7, 8])
    assert c[0] != a[0] and c[1] != a[1], "a change in page 0 changes every later key"
    assert keys_of([9, 9, 9, 9, 5, 6, 7, 8])[1] != a[1], "same tokens after a different parent"


def test_salt_separates_chains_and_enters_the_first_page_only():
    plain, salted, other = keys_of(list(range(8))), keys_of(list(range(8)), "alice"), keys_of(list(range(8)), "bob")
    assert plain[0] != salted[0] != other[0] and salted[1] != other[1]
    assert salted[1] == page_key(salted[0], [4, 5, 6, 7]), "later pages chain on the parent alone"


def test_extend_page_keys_is_incremental():
    tokens = list(range(20))
    keys = extend_page_keys([], 2, PAGE, lambda a, b: tokens[a:b])
    assert extend_page_keys(keys, 5, PAGE, lambda a, b: tokens[a:b]) == keys_of(tokens)


# The page pool ----------------------------------------------------------------------------------------

def test_freed_pages_keep_their_key_until_allocation_evicts_them_lru_first():
    kv = KVCacheManager(num_pages=5, page_size=PAGE)  # 4 usable
    a, b = [], []
    assert kv.allocate(a, 8) and kv.allocate(b, 8)
    kv.cache_pages(a, [b"a0", b"a1"], 0, 2)
    kv.free(a)
    kv.cache_pages(b, [b"b0", b"b1"], 0, 1)  # b's second page stays unkeyed
    kv.free(b)
    assert kv.num_free_pages == 4 and kv.num_cached_pages == 3 and kv.usage == 0.0
    assert kv.cached_prefix([b"a0", b"a1", b"x"]) == [1, 2]
    c: list[int] = []
    assert kv.allocate(c, 4) and c == [4], "an unkeyed free page is taken before any cached one"
    assert kv.allocate(c, 8) and c == [4, 2], "then the least recently freed, a's tail before its head"
    assert kv.cached_prefix([b"a0", b"a1"]) == [1] and kv.num_cached_pages == 2


def test_hits_share_pages_by_reference_count():
    kv = KVCacheManager(num_pages=5, page_size=PAGE)
    a: list[int] = []
    kv.allocate(a, 8)
    kv.cache_pages(a, [b"k0", b"k1"], 0, 2)
    hit = kv.cached_prefix([b"k0", b"k1"])
    kv.take(hit)
    assert [kv.ref_count(p) for p in hit] == [2, 2]
    b = list(hit)
    kv.free(a)
    assert kv.num_free_pages == 2 and [kv.ref_count(p) for p in hit] == [1, 1], "b still holds them"
    kv.free(b)
    assert_all_released(kv)
    kv.take(kv.cached_prefix([b"k0"]))
    assert kv.num_free_pages == 3, "a hit revives a free cached page"


def test_a_duplicate_key_keeps_the_first_page():
    kv = KVCacheManager(num_pages=5, page_size=PAGE)
    a, b = [], []
    kv.allocate(a, 4), kv.allocate(b, 4)
    kv.cache_pages(a, [b"k"], 0, 1)
    kv.cache_pages(b, [b"k"], 0, 1)
    assert kv.cached_prefix([b"k"]) == a and not kv.is_cached(b[0])


def test_disabled_caching_keys_nothing():
    kv = KVCacheManager(num_pages=5, page_size=PAGE, enable_prefix_caching=False)
    a: list[int] = []
    kv.allocate(a, 8)
    kv.cache_pages(a, [b"k0", b"k1"], 0, 2)
    assert kv.num_cached_pages == 0 and kv.cached_prefix([b"k0"]) == []


# The scheduler ----------------------------------------------------------------------------------------

def test_a_second_request_starts_after_the_cached_prefix():
    sched = Scheduler(KVCacheManager(64, PAGE), max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(10, 21))  # 11 tokens: pages 0-1 full
    sched.add_request(make_request("a", prompt))
    drain(sched)
    b = make_request("b", [*prompt, 99])
    sched.add_request(b)
    out = run_step(sched)
    (item,) = rows(out)
    assert item.start_position == 8 and item.token_ids == (18, 19, 20, 99)
    assert b.num_cached_tokens == 8 and (sched.prefix_cache_queries, sched.prefix_cache_hits) == (11 + 12, 8)
    drain(sched)
    assert_all_released(sched.kv_cache)


def test_a_fully_cached_prompt_still_computes_its_last_page():
    sched = Scheduler(KVCacheManager(64, PAGE), max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(10, 18))  # exactly two pages
    sched.add_request(make_request("a", prompt))
    drain(sched)
    sched.add_request(make_request("b", prompt))
    (item,) = rows(run_step(sched))
    assert item.start_position == 4 and len(item.token_ids) == 4, "the hit stops short of the last token"
    page_ids = sched.requests["b"].page_ids
    assert page_ids[1] != sched.kv_cache.cached_prefix(keys_of(prompt))[1], "recomputed into its own page"


def test_partial_pages_are_never_cached():
    sched = Scheduler(KVCacheManager(64, PAGE), max_num_seqs=4, max_num_batched_tokens=64)
    sched.add_request(make_request("a", [5, 6, 7], max_tokens=1))
    drain(sched)
    assert sched.kv_cache.num_cached_pages == 0


def test_generated_tokens_are_cached_too():
    sched = Scheduler(KVCacheManager(64, PAGE), max_num_seqs=4, max_num_batched_tokens=64)
    sched.add_request(make_request("a", [5, 6, 7], max_tokens=6))
    drain(sched)  # 3 + 6 tokens, of which 8 computed (the last sample is never fed back)
    assert sched.kv_cache.num_cached_pages == 2
    sched.add_request(make_request("b", [5, 6, 7, 7, 7, 7, 7, 7, 1]))
    assert run_step(sched).start_positions[0] == 8


def test_salted_requests_do_not_share():
    sched = Scheduler(KVCacheManager(64, PAGE), max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(10, 23))
    sched.add_request(make_request("a", prompt, salt="alice"))
    drain(sched)
    sched.add_request(make_request("b", prompt, salt="bob"))
    assert run_step(sched).start_positions[0] == 0
    drain(sched)
    sched.add_request(make_request("c", prompt, salt="alice"))
    assert run_step(sched).start_positions[0] == 12


def test_prompt_logprob_requests_compute_their_prompt():
    sched = Scheduler(KVCacheManager(64, PAGE), max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(10, 23))
    sched.add_request(make_request("a", prompt))
    drain(sched)
    sched.add_request(make_request("b", prompt, prompt_logprobs=0))
    assert run_step(sched).start_positions[0] == 0


def test_siblings_wait_one_step_for_a_page_being_computed_then_share_it():
    sched = Scheduler(KVCacheManager(64, PAGE), max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(10, 23))  # 13 tokens: 3 full pages
    for i in range(3):
        sched.add_request(make_request(f"r#{i}", prompt))
    first = run_step(sched)
    assert first.request_ids == ["r#0"], "the siblings wait for r#0's pages"
    second = run_step(sched)
    assert sorted(row[:2] for row in shares(second)) == [("r#0", 13), ("r#1", 12), ("r#2", 12)]
    pages = [sched.requests[request_id].page_ids[:3] for request_id in second.request_ids]
    assert pages[0] == pages[1] == pages[2] and all(sched.kv_cache.ref_count(p) == 3 for p in pages[0])
    drain(sched)
    assert_all_released(sched.kv_cache)


def test_preemption_and_abort_release_references():
    kv = KVCacheManager(9, PAGE)  # 8 usable pages
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(10, 19))  # 9 tokens: 2 full pages
    sched.add_request(make_request("a", prompt, max_tokens=16))
    run_step(sched)
    run_step(sched)
    sched.add_request(make_request("b", prompt, max_tokens=16))
    sched.add_request(make_request("c", prompt, max_tokens=16))
    preempted = []
    for _ in range(30):
        if not sched.has_unfinished():
            break
        preempted += run_step(sched).preempted_ids
        if "c" in sched.requests and sched.requests["c"].num_output_tokens >= 6:
            sched.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert preempted, "the pool is small enough to force preemption"
    assert not sched.has_unfinished()
    assert_all_released(kv)
    assert kv.num_cached_pages > 0, "finished requests leave their pages cached"


def test_random_traffic_keeps_every_invariant():
    """Shared prefixes, n > 1 siblings, aborts, preemption and eviction in a small pool, at random."""
    rng = random.Random(0)
    kv = KVCacheManager(14, PAGE)
    sched = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=16)
    systems = [[rng.randrange(3, 50) for _ in range(rng.randrange(1, 14))] for _ in range(3)]
    next_id = 0
    for _ in range(400):
        if rng.random() < 0.3 and len(sched.requests) < 12:
            prompt = rng.choice(systems) + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 6))]
            for sibling in range(rng.choice([1, 1, 2, 3])):
                sched.add_request(make_request(f"q{next_id}#{sibling}", prompt, max_tokens=rng.randrange(1, 20),
                                               salt=rng.choice([None, None, "s"])))
            next_id += 1
        if rng.random() < 0.05 and sched.requests:
            sched.finish_requests([rng.choice(list(sched.requests))], RequestStatus.FINISHED_ABORTED)
        run_step(sched, token=rng.randrange(3, 50))
        held = [p for r in sched.requests.values() for p in r.page_ids]
        for page in range(1, kv.num_pages):
            assert kv.ref_count(page) == held.count(page)
        assert kv.num_free_pages == sum(kv.ref_count(p) == 0 for p in range(1, kv.num_pages))
    drain(sched)
    assert_all_released(kv)
    print(sched.prefix_cache_hits, sched.prefix_cache_queries, sched.num_preemptions)
    assert sched.prefix_cache_hits > 0.3 * sched.prefix_cache_queries and sched.num_preemptions > 0, (
        "the traffic exercised hits and preemption")
