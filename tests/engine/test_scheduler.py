"""Scheduler and KV-page manager: pure Python, tested in milliseconds with no model."""

import itertools
import subprocess
import sys

import numpy as np
import pytest

from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.request import Request, RequestStatus, request_metrics
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.step_io import PENDING_TOKEN, StepOutput
from jaxserve.sampling_params import InvalidParam, RequestLimits, SamplingParams
from tests.engine.sent_pages import plan, replay, rows, shares

_prompt_starts = itertools.count(10, 1000)  # every request its own prompt: no prefix-cache hits here


def make_request(request_id: str, num_prompt: int, max_tokens: int = 4) -> Request:
    start = next(_prompt_starts)
    return Request(request_id, list(range(start, start + num_prompt)), SamplingParams(max_tokens=max_tokens,
                   ignore_eos=True), eos_token_ids=(2,), max_model_len=1024, sampling_seed=0)


def run_step(scheduler: Scheduler, token: int = 7):
    """One step, with the pages sent to the runner replayed (`SentPages`) and checked."""
    out = scheduler.schedule()
    replay(scheduler, out)
    ids = out.request_ids
    scheduler.update(out, StepOutput(ids, [token] * len(ids), [0.0] * len(ids)))
    return out


def test_host_side_modules_do_not_import_jax():
    code = ("import sys, jaxserve.engine.scheduler, jaxserve.engine.kv_cache_manager, jaxserve.engine.step_io, "
            "jaxserve.engine.detokenizer, jaxserve.runner.buckets, jaxserve.runner.request_rows; "
            "assert 'jax' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_kv_manager_allocates_and_frees_without_page_zero():
    kv = KVCacheManager(num_pages=5, page_size=4)
    pages: list[int] = []
    assert kv.allocate(pages, 9) and len(pages) == 3 and 0 not in pages
    assert not kv.allocate(pages, 40) and len(pages) == 3, "a failed allocation changes nothing"
    kv.free(pages)
    assert pages == [] and kv.num_free_pages == 4 and kv.usage == 0.0


def test_chunked_prefill_then_decode_within_budget():
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=4, max_num_batched_tokens=8)
    sched.add_request(make_request("a", 13))
    first = run_step(sched)
    assert first.num_new_tokens == [8]
    assert sched.requests["a"].num_output_tokens == 0, "a partial prefill samples nothing"
    second = run_step(sched)
    assert second.start_positions == [8] and second.num_new_tokens == [5]
    assert sched.requests["a"].output_token_ids == [7]
    third = run_step(sched)
    assert shares(third) == [("a", 13, (7,))]
    assert not (third.new_pages or third.new_requests or third.rows_completing_pages), \
        "a decode inside its page carries nothing but its columns"


def test_decodes_go_first_and_waiting_requests_fill_the_rest():
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=4, max_num_batched_tokens=10)
    sched.add_request(make_request("a", 4))
    run_step(sched)
    sched.add_request(make_request("b", 20))
    out = run_step(sched)
    assert list(zip(out.request_ids, out.num_new_tokens, strict=True)) == [("a", 1), ("b", 9)]


def test_max_num_seqs_is_respected():
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 3))
    out = run_step(sched)
    assert out.num_reqs == 2 and len(sched.waiting) == 1


def test_preemption_frees_the_newest_and_recomputes_it():
    sched = Scheduler(KVCacheManager(5, 4), max_num_seqs=4, max_num_batched_tokens=100)  # 4 usable pages
    sched.add_request(make_request("old", 8, max_tokens=8))
    sched.add_request(make_request("new", 8, max_tokens=8))
    run_step(sched)  # both prefilled: 2 pages each, the pool is empty
    out = run_step(sched)  # both need a third page: "new" is preempted
    assert out.preempted_ids == ("new",)
    new = sched.requests["new"]
    assert new.num_computed_tokens == 0 and new.page_ids == [] and sched.waiting[0] is new
    assert new.output_token_ids == [7], "generated tokens survive preemption and are recomputed"
    while sched.has_unfinished():
        run_step(sched)
    assert sched.kv_cache.num_free_pages == 4


def test_finish_and_abort_free_pages_immediately():
    sched = Scheduler(KVCacheManager(16, 4), max_num_seqs=4, max_num_batched_tokens=100)
    sched.add_request(make_request("a", 9))
    sched.add_request(make_request("b", 3))
    run_step(sched)
    [aborted] = sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert aborted.status is RequestStatus.FINISHED_ABORTED and "a" not in sched.requests
    assert sched.kv_cache.num_free_pages == 15 - 1


def test_request_too_large_for_the_cache_is_rejected():
    sched = Scheduler(KVCacheManager(3, 4), max_num_seqs=4, max_num_batched_tokens=100)
    with pytest.raises(ValueError, match="KV cache"):
        sched.add_request(make_request("big", 6, max_tokens=10))


def test_length_and_eos_finish_reasons():
    request = make_request("a", 3, max_tokens=2)
    request.append_output_token(5, 0.0)
    assert not request.status.is_finished
    request.append_output_token(6, 0.0)
    assert request.status is RequestStatus.FINISHED_LENGTH
    eos = Request("b", [1, 2], SamplingParams(max_tokens=9), eos_token_ids=(2,), max_model_len=64, sampling_seed=0)
    eos.append_output_token(2, 0.0)
    assert eos.status is RequestStatus.FINISHED_STOPPED


def test_preemptions_are_counted_and_stage_stamps_survive_them():
    sched = Scheduler(KVCacheManager(5, 4), max_num_seqs=4, max_num_batched_tokens=100)  # 4 usable pages
    old, new = make_request("old", 8, max_tokens=8), make_request("new", 8, max_tokens=8)
    sched.add_request(old)
    sched.add_request(new)
    assert new.first_scheduled_time is None and new.first_token_time is None
    run_step(sched)
    scheduled, first_token = new.first_scheduled_time, new.first_token_time
    assert new.arrival_time <= scheduled <= first_token == new.last_token_time
    out = run_step(sched)
    assert out.preempted_ids == ("new",) and sched.num_preemptions == 1 and new.num_preemptions == 1
    while sched.has_unfinished():
        run_step(sched)
    assert sched.num_preemptions == new.num_preemptions + old.num_preemptions
    assert (new.first_scheduled_time, new.first_token_time) == (scheduled, first_token), "kept across preemption"
    assert new.last_token_time > first_token and new.num_output_tokens == 8


def test_iteration_tokens_histogram_counts_each_step():
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=4, max_num_batched_tokens=8)
    sched.add_request(make_request("a", 13, max_tokens=2))
    steps = []
    while sched.has_unfinished():
        steps.append(run_step(sched).num_tokens)
    assert steps == [8, 5, 1]
    histogram = sched.iteration_tokens
    assert histogram.sum == 14 and sum(histogram.bucket_counts) == 3
    assert histogram.bucket_counts[:2] == [1, 2], "1 token in the <=1 bucket, 5 and 8 in the <=8 bucket"
    sched.schedule()  # an empty step is not an iteration
    assert sum(histogram.bucket_counts) == 3


def test_request_metrics_spans_a_parents_sequences():
    first, second = make_request("p#0", 3), make_request("p#1", 3)
    first.arrival_time = second.arrival_time = 10.0
    first.first_scheduled_time, second.first_scheduled_time = 11.0, 12.0
    first.first_token_time, second.first_token_time = 13.0, 12.5
    first.last_token_time, second.last_token_time = 20.0, 18.0
    second.num_preemptions = 2
    metrics = request_metrics([first, second], first.sampling_params.max_tokens)
    assert (metrics.queue_time, metrics.prefill_time, metrics.decode_time, metrics.inference_time) == (
        1.0, 1.5, 7.5, 9.0)
    assert metrics.num_preemptions == 2 and metrics.max_tokens_param == 4
    waiting = request_metrics([make_request("w", 3)], None)
    assert waiting.queue_time is None and waiting.inference_time is None, "aborted while waiting: no stages"


def test_scheduled_requests_carry_plain_values_fixed_at_scheduling():
    """The runner's view of a request: what this step computes and samples, decided by the engine, and
    unaffected by what happens to the live Request afterwards."""
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=4, max_num_batched_tokens=6)
    params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[5], prompt_logprobs=1, seed=3)
    request = Request("a", list(range(10, 19)), params, eos_token_ids=(2,), max_model_len=1024, sampling_seed=9)
    sched.add_request(request)
    out = sched.schedule()
    (chunk,) = rows(out)  # 6 of 9 prompt tokens: a chunk whose sample is dropped
    assert (chunk.request_id, chunk.start_position, chunk.token_ids) == ("a", 0, tuple(range(10, 16)))
    assert not chunk.keeps_sample and chunk.banned_token_ids == () and out.grammar_rows == ()
    assert chunk.prompt_logprob_targets == tuple(range(11, 17))
    assert (chunk.new.sampling_seed, chunk.new.num_prompt_tokens, chunk.num_output_tokens) == (9, 9, 0)
    assert chunk.new.num_prompt_logprobs == 1 and chunk.new.fills_row and not chunk.new.has_penalties
    sched.update(plan([chunk]), StepOutput(["a"], [7], [0.0]))

    (last,) = rows(sched.schedule())  # the prompt's last 3 tokens: the sample is the first output
    assert last.keeps_sample and last.prompt_logprob_targets == (17, 18)  # the last prompt token scores nothing
    assert last.banned_token_ids == (5, 2), "below min_tokens, the stop id and EOS are banned"
    sched.update(plan([last]), StepOutput(["a"], [7], [0.0]))
    (decode,) = rows(sched.schedule())
    assert decode.num_output_tokens == 1 and decode.banned_token_ids == (5, 2)
    sched.update(plan([decode]), StepOutput(["a"], [8], [0.0]))
    assert decode.num_output_tokens == 1 and decode.token_ids == (7,), "a plan does not follow the request"
    assert rows(sched.schedule())[0].banned_token_ids == (), "min_tokens reached: nothing banned"


def test_a_request_resumed_after_a_prefix_hit_carries_its_cached_tokens_for_penalties():
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(10, 20))
    penalised = SamplingParams(max_tokens=2, ignore_eos=True, presence_penalty=0.5)
    sched.add_request(Request("a", prompt, penalised, eos_token_ids=(2,), max_model_len=1024, sampling_seed=0))
    first = rows(run_step(sched))[0]
    assert first.start_position == 0 and first.cached_token_ids is None, "from 0, the step fills the row itself"
    sched.add_request(Request("b", [*prompt, 99], penalised, eos_token_ids=(2,), max_model_len=1024,
                              sampling_seed=0))
    (hit,) = [s for s in rows(run_step(sched)) if s.request_id == "b"]
    assert hit.start_position == 8 and hit.cached_token_ids == tuple(prompt[:8])
    (again,) = [s for s in rows(run_step(sched)) if s.request_id == "b"]
    assert again.cached_token_ids is None, "only the step that resumes it"


def test_the_runner_is_sent_each_page_once_and_again_after_a_step_taken_back():
    sched = Scheduler(KVCacheManager(16, 4), max_num_seqs=4, max_num_batched_tokens=100)
    sched.add_request(make_request("a", 7, max_tokens=8))
    first = sched.schedule()
    replay(sched, first)
    (item,) = rows(first)
    assert item.resumed and item.first_new_page == 0 and len(item.new_page_ids) == 2
    sched.unschedule(first)  # its batch could not be built: the runner may or may not have the pages
    out = sched.schedule()
    replay(sched, out)
    (again,) = rows(out)
    assert (again.first_new_page, again.new_page_ids) == (0, item.new_page_ids)
    sched.update(out, StepOutput(["a"], [7], [0.0]))
    (decode,) = rows(run_step(sched))  # position 7: the second page still has room
    assert (decode.first_new_page, decode.new_page_ids) == (None, ()), "no page to send"
    (decode,) = rows(run_step(sched))  # position 8: a third page
    assert decode.first_new_page == 2 and decode.new_page_ids == (sched.requests["a"].page_ids[2],)


def test_a_decode_carries_only_columns_unless_an_event_or_a_feature_needs_more():
    """A decode inside its page is a few column entries; a page to allocate (sent) or to complete (keyed
    for the prefix cache) and a feature the runner fills row by row add sparse entries for that row only."""
    sched = Scheduler(KVCacheManager(64, 4, enable_prefix_caching=True), max_num_seqs=8, max_num_batched_tokens=64)
    special = {
        "penalty": dict(presence_penalty=0.5), "bias": dict(logit_bias={3: 1.0}),
        "min": dict(min_tokens=7, stop_token_ids=[3]), "prompt_lp": dict(prompt_logprobs=0), "top_lp": dict(logprobs=2),
    }
    plain = Request("plain", [10, 11, 12, 13, 14], SamplingParams(max_tokens=7, ignore_eos=True, logprobs=0),
                    eos_token_ids=(2,), max_model_len=1024, sampling_seed=0)
    sched.add_request(plain)
    for i, (name, extra) in enumerate(special.items()):
        sched.add_request(Request(name, [20 + i] * 5, SamplingParams(max_tokens=7, ignore_eos=True, **extra),
                                  eos_token_ids=(2,), max_model_len=1024, sampling_seed=0))
    first = run_step(sched, token=4)
    assert [new.request_id for new in first.new_requests] == first.request_ids, "every request takes its row"
    assert [new.fills_row for new in first.new_requests] == [False, True, True, True, True, False]
    events = []
    for position in range(5, 10):
        out = run_step(sched, token=position)
        assert out.request_ids[0] == "plain" and not out.new_requests
        # the token at `position` is output `position - 5`; the sample is the next
        assert (out.token_ids[0], out.start_positions[0], out.output_indices[0]) == (position - 1, position,
                                                                                   position - 4)
        assert set(out.banned_token_ids) == {out.request_ids.index("min")}, "only min_tokens bans"
        events.append((0 in out.new_pages, 0 in out.rows_completing_pages))
    # Positions 5, 6: inside page 1. 7: completes it (its key is offered). 8: a new page. 9: inside it.
    assert events == [(False, False), (False, False), (False, True), (True, False), (False, False)]
    assert plain.output_token_ids == [4, 5, 6, 7, 8, 9] and plain.output_logprobs == [0.0] * 6
    assert sched.kv_cache.is_cached(plain.page_ids[1]), "the completed page was keyed"


def test_plain_decodes_are_taken_back_and_finish_like_records():
    sched = Scheduler(KVCacheManager(64, 8), max_num_seqs=4, max_num_batched_tokens=64)
    for name in "ab":
        sched.add_request(make_request(name, 3, max_tokens=3))
    run_step(sched)
    out = sched.schedule()
    assert out.request_ids == ["a", "b"] and out.start_positions == [3, 3]
    sched.unschedule(out)  # its batch could not be built: both are planned again from where they were
    again = sched.schedule()
    assert again == out
    a = sched.requests["a"]
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)  # aborted while the step runs
    with pytest.raises(ValueError, match="1 sampled_token_ids for 2 requests"):
        sched.update(again, StepOutput(["a"], [8], [0.0]))
    assert sched.update(again, StepOutput(again.request_ids, [8, 9], [0.0, 0.0])) == [a]
    assert a.output_token_ids == [7, 8]
    run_step(sched)
    assert a.status is RequestStatus.FINISHED_LENGTH and not sched.has_unfinished()


def test_a_decode_scheduled_while_its_token_is_in_flight_is_pending():
    """Async scheduling: step N + 1 is planned before step N is read. The decode of a token still in flight
    carries PENDING_TOKEN and the index its own sample will have; the one after reads the real token."""
    sched = Scheduler(KVCacheManager(64, 8), max_num_seqs=4, max_num_batched_tokens=64)
    sched.add_request(make_request("a", 3, max_tokens=4))
    prefill = sched.schedule()
    first_decode = sched.schedule()  # before the prefill's sample (output 0) is read
    assert shares(first_decode) == [("a", 3, (PENDING_TOKEN,))] and first_decode.output_indices == [1]
    sched.update(prefill, StepOutput(["a"], [7], [0.0]))
    second_decode = sched.schedule()  # output 1 still in flight
    assert shares(second_decode) == [("a", 4, (PENDING_TOKEN,))] and second_decode.output_indices == [2]
    sched.update(first_decode, StepOutput(["a"], [8], [0.0]))
    sched.update(second_decode, StepOutput(["a"], [9], [0.0]))
    third = sched.schedule()  # synchronous again: the last token is known
    assert shares(third) == [("a", 5, (9,))] and third.output_indices == [3]
    sched.update(third, StepOutput(["a"], [10], [0.0]))
    assert not sched.has_unfinished(), "its fourth token finished it"


@pytest.mark.parametrize("params,first_k_step_at", [
    (dict(repetition_penalty=1.2, logit_bias={5: 1.0}, allowed_token_ids=[7, 8]), 1),  # from the first decode
    (dict(min_tokens=6, frequency_penalty=0.5), 6),  # once min_tokens' bans are over
    (dict(bad_words=["x"]), None),  # bans the host decides each step
    (dict(logprobs=3), None),  # top logprobs, which the k-step program does not return
])
def test_k_step_plans_take_rows_that_decode_on_the_device(params, first_k_step_at):
    k = 4
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64, num_scheduler_steps=k)
    request = Request("r", list(range(10, 15)), SamplingParams(max_tokens=24, ignore_eos=True, **params),
                      eos_token_ids=(2,), max_model_len=1024, sampling_seed=0,
                      bad_words_token_ids=((99,),) if "bad_words" in params else ())
    sched.add_request(request)
    k_step_plans_at = []  # the outputs the request had when each k-step plan was made
    while sched.has_unfinished():
        out = sched.schedule()
        replay(sched, out)
        if out.is_multi_step:
            k_step_plans_at.append(len(request.output_token_ids))
        read = [StepOutput(out.request_ids, [7] * out.num_reqs, [0.0] * out.num_reqs)] * out.num_steps
        sched.update_steps(out, read) if out.is_multi_step else sched.update(out, read[0])
    assert len(request.output_token_ids) == 24
    assert (k_step_plans_at[0] if k_step_plans_at else None) == first_k_step_at, k_step_plans_at


def test_a_k_step_plan_counts_the_tokens_its_rows_compute():
    """vllm:iteration_tokens_total: a k-step decode computes each row's token once a step the row runs; a
    row that ends before k (its max_tokens) computes fewer."""
    k = 4
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64, num_scheduler_steps=k)
    for request_id, max_tokens in (("long", 9), ("short", 3)):
        sched.add_request(make_request(request_id, 5, max_tokens))
    multi_step = False
    while sched.has_unfinished():
        out = sched.schedule()
        replay(sched, out)
        multi_step |= out.is_multi_step and len(set(out.decode_steps)) > 1
        read = [StepOutput(out.request_ids, [7] * out.num_reqs, [0.0] * out.num_reqs)] * out.num_steps
        sched.update_steps(out, read) if out.is_multi_step else sched.update(out, read[0])
    assert multi_step, "a k-step plan whose rows run different steps"
    assert sched.iteration_tokens.sum == 5 + 5 + 8 + 2, "two prompts, then the 8 and 2 tokens fed after the first"


def _embedding_request(request_id: str, prompt: list[int], pooling_type: str = "mean") -> Request:
    request = Request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                      eos_token_ids=(2,), max_model_len=64, sampling_seed=0)
    request.pool(pooling_type)  # what EngineCore.add_sequences does under --runner pooling
    return request


def _pooled_step(out) -> StepOutput:
    """The runner's answer with a token's hidden state its id: per row, (the first token's, the last token's, the
    chunk's sum), so a prompt's mean pooling is the mean of its ids."""
    pooled, first = {}, 0
    for row, count in enumerate(out.num_new_tokens):
        tokens = out.token_ids[first:first + count]
        first += count
        pooled[row] = (np.array([float(tokens[0])]), np.array([float(tokens[-1])]), np.array([float(sum(tokens))]))
    return StepOutput(out.request_ids, [7] * out.num_reqs, [0.0] * out.num_reqs, pooled=pooled)


@pytest.mark.parametrize("pooling_type", ["mean", "cls"])
def test_a_pooling_preempted_with_a_chunk_in_flight_is_its_prompt_s(pooling_type):
    """Async scheduling (step N + 1 planned before step N is read): a request preempted while a chunk is in
    flight (a decode ahead of it needs its page) still has that chunk read, then starts over from its first
    token; its embedding counts each token once (mean), or is its first token's, from its first chunk (cls)."""
    scheduler = Scheduler(KVCacheManager(4, 4, enable_prefix_caching=False), max_num_seqs=4,
                          max_num_batched_tokens=6)
    decoding = make_request("d", 3, max_tokens=3)
    pooled = _embedding_request("a", list(range(10, 18)), pooling_type)
    scheduler.add_request(decoding)
    scheduler.add_request(pooled)
    in_flight = None
    for _ in range(40):
        if not scheduler.has_unfinished() and in_flight is None:
            break
        out = scheduler.schedule()
        if in_flight is not None:
            scheduler.update(in_flight, _pooled_step(in_flight))
        in_flight = None if out.is_empty else out
    assert pooled.num_preemptions == 1 and pooled.status is RequestStatus.FINISHED_LENGTH, "the case preempts a"
    assert decoding.status is RequestStatus.FINISHED_LENGTH and decoding.num_preemptions == 0
    expected = np.mean(pooled.prompt_token_ids) if pooling_type == "mean" else pooled.prompt_token_ids[0]
    assert pooled.embedding == [float(expected)]


def test_a_pooled_prompt_may_fill_the_cache_and_one_token_more_may_not():
    """A pooled request's one sample is dropped and takes no position: a prompt of the cache's capacity (under
    --max-model-len auto, of max_model_len) fits it, in the frontend's check and the scheduler's."""
    limits = RequestLimits(vocab_size=100, max_model_len=17, max_logprobs=0, max_biased_tokens=8, num_eos_tokens=1,
                           kv_capacity_tokens=16)
    limits.check_length(16, 1, pooled=True)
    with pytest.raises(InvalidParam, match="needs up to 17 tokens of KV cache"):
        limits.check_length(17, 1, pooled=True)
    scheduler = Scheduler(KVCacheManager(5, 4, enable_prefix_caching=False), max_num_seqs=2, max_num_batched_tokens=16)
    filling, over = _embedding_request("e", list(range(10, 26))), _embedding_request("f", list(range(10, 27)))
    with pytest.raises(ValueError, match="needs up to 17 tokens of KV cache but the cache holds 16"):
        scheduler.add_request(over)
    scheduler.add_request(filling)
    out = scheduler.schedule()
    assert out.num_new_tokens == [16] and len(filling.page_ids) == 4
    scheduler.update(out, _pooled_step(out))
    assert filling.status is RequestStatus.FINISHED_LENGTH
    assert filling.embedding == [float(np.mean(filling.prompt_token_ids))]


def test_a_prefill_with_no_one_else_to_preempt_takes_the_free_pages_or_waits_in_its_own():
    """A prefill chunk that needs pages when the running list's end is itself: a shorter chunk in the free
    pages, or none this step. Preempting itself (as before) dropped its chunks for pages that no one took,
    and the next plan started it again into the same pages, for as long as the decode ahead of it held its
    own (here, under a window, for ever: the decode's pages never grow)."""
    for window, expected_tokens in ((None, 32 + 61), (20, 61)):  # without a window the decode takes P's pages once
        scheduler = Scheduler(KVCacheManager(6, 16, enable_prefix_caching=False, sliding_window=window),
                              max_num_seqs=4, max_num_batched_tokens=20)
        decoding, prefill = make_request("D", 40, max_tokens=40), make_request("P", 60, max_tokens=2)
        scheduler.add_request(decoding)
        computed = 0
        for step in range(200):
            if step == 3:
                scheduler.add_request(prefill)
            if not scheduler.has_unfinished():
                break
            out = run_step(scheduler)
            computed += sum(n for r, n in zip(out.request_ids, out.num_new_tokens, strict=True) if r == "P")
        assert prefill.status.is_finished and decoding.status.is_finished
        assert prefill.num_preemptions == (window is None) and computed == expected_tokens, (window, computed)


def test_a_mean_pooling_that_yields_with_its_last_chunk_in_flight_finishes_with_its_prompt_s_mean():
    """The priority policy: a request yields to an urgent one while its prompt's last chunk is in flight; that
    chunk's step still completes it, with the sum of every chunk."""
    scheduler = Scheduler(KVCacheManager(3, 4, enable_prefix_caching=False), max_num_seqs=4,
                          max_num_batched_tokens=4, policy="priority")
    request = _embedding_request("a", list(range(10, 17)))  # chunks [0, 4) and [4, 7)
    request.priority = 1
    scheduler.add_request(request)
    first_chunk = scheduler.schedule()
    last_chunk = scheduler.schedule()  # planned before the first is read
    scheduler.update(first_chunk, _pooled_step(first_chunk))
    scheduler.add_request(_embedding_request("urgent", [30, 31, 32, 33]))
    assert scheduler.schedule().preempted_ids == ("a",)
    scheduler.update(last_chunk, _pooled_step(last_chunk))
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert request.embedding == [float(np.mean(request.prompt_token_ids))]


def test_whole_prompts_are_never_split_over_steps():
    """An encoder's scheduler (`whole_prompts`): a prompt that the step's budget left cannot take waits at the
    queue's head for the next step, and the ones behind it wait too; a prompt of the whole budget fits."""
    scheduler = Scheduler(KVCacheManager(64, 4, enable_prefix_caching=False), max_num_seqs=8,
                          max_num_batched_tokens=10, whole_prompts=True)
    requests = [_embedding_request(name, list(range(10, 10 + length)))
                for name, length in (("a", 6), ("b", 6), ("c", 3), ("d", 10))]
    for request in requests:
        scheduler.add_request(request)
    planned = []
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        planned.append(list(zip(out.request_ids, out.num_new_tokens, out.start_positions, strict=True)))
        scheduler.update(out, _pooled_step(out))
    assert planned == [[("a", 6, 0)], [("b", 6, 0), ("c", 3, 0)], [("d", 10, 0)]]
    assert [r.embedding for r in requests] == [[float(np.mean(r.prompt_token_ids))] for r in requests]
    with pytest.raises(ValueError, match="a prompt of 11 tokens is read whole in one step, which takes 10"):
        scheduler.add_request(_embedding_request("e", list(range(10, 21))))
    assert not scheduler.waiting  # refused, not queued where it would hold the queue forever
