"""The priority policy (vLLM's `--scheduling-policy priority`): order, preemption and fairness, pure Python."""

import dataclasses
import itertools

import pytest

from jaxserve.config import SchedulerConfig
from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.step_io import StepOutput
from jaxserve.sampling_params import InvalidParam, check_priority
from tests.engine.sent_pages import replay
from tests.engine.test_scheduler import make_request, run_step


def prioritized(request_id: str, priority: int, num_prompt: int = 4, max_tokens: int = 4, arrival: float = 0.0):
    return dataclasses.replace(make_request(request_id, num_prompt, max_tokens), priority=priority,
                               arrival_time=arrival)


def admission_order(sched: Scheduler) -> list[str]:
    """Request ids in the order they first get a row, stepping until all finish."""
    order: list[str] = []
    while sched.has_unfinished():
        for request_id in run_step(sched).request_ids:
            if request_id not in order:
                order.append(request_id)
    return order


def test_one_slot_serves_lower_priority_values_first_then_arrival_order():
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=1, max_num_batched_tokens=64, policy="priority")
    for arrival, (request_id, priority) in enumerate([("late-low", 5), ("a", 0), ("urgent", -3), ("b", 0)]):
        sched.add_request(prioritized(request_id, priority, arrival=float(arrival)))
    assert admission_order(sched) == ["urgent", "a", "b", "late-low"]


def test_fcfs_ignores_priority_values():
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=1, max_num_batched_tokens=64)
    for arrival, (request_id, priority) in enumerate([("first", 5), ("second", -3)]):
        sched.add_request(prioritized(request_id, priority, arrival=float(arrival)))
    assert admission_order(sched) == ["first", "second"]


def test_running_out_of_pages_preempts_the_lowest_priority_not_the_newest():
    sched = Scheduler(KVCacheManager(5, 4), max_num_seqs=4, max_num_batched_tokens=100, policy="priority")
    sched.add_request(prioritized("low-old", 9, num_prompt=8, max_tokens=8, arrival=0.0))
    sched.add_request(prioritized("high-new", 1, num_prompt=8, max_tokens=8, arrival=1.0))
    run_step(sched)  # both prefilled: 2 pages each, the pool is empty
    out = run_step(sched)  # both need a third page
    assert out.preempted_ids == ("low-old",), "fcfs would preempt the newest, high-new"
    assert sched.waiting[0].request_id == "low-old"
    while sched.has_unfinished():
        run_step(sched)
    assert sched.kv_cache.num_free_pages == 4


def test_an_urgent_arrival_preempts_a_running_lower_priority_request_for_its_slot():
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=1, max_num_batched_tokens=64, policy="priority")
    sched.add_request(prioritized("background", 5, max_tokens=20))
    run_step(sched)
    run_step(sched)
    sched.add_request(prioritized("urgent", 0, arrival=1.0))
    out = run_step(sched)
    assert out.preempted_ids == ("background",) and out.request_ids == ["urgent"]
    background = sched.requests["background"]
    assert background.output_token_ids == [7, 7], "its tokens survive; it is recomputed after"
    order = admission_order(sched)
    assert order[0] == "urgent" and "background" in order and not sched.has_unfinished()


def test_an_urgent_arrival_preempts_for_pages_and_equal_priorities_never_preempt_each_other():
    sched = Scheduler(KVCacheManager(5, 4), max_num_seqs=4, max_num_batched_tokens=100, policy="priority")
    sched.add_request(prioritized("low", 5, num_prompt=12, max_tokens=4))  # 3 of the 4 usable pages
    run_step(sched)
    sched.add_request(prioritized("peer", 5, num_prompt=8, arrival=1.0))  # needs 2 pages: waits, no preemption
    assert run_step(sched).preempted_ids == ()
    assert [r.request_id for r in sched.waiting] == ["peer"]
    sched.add_request(prioritized("urgent", 1, num_prompt=8, arrival=2.0))
    out = run_step(sched)
    assert out.preempted_ids == ("low",) and "urgent" in out.request_ids
    assert [r.request_id for r in sched.waiting] == ["low", "peer"], "the victim keeps its place among equals"
    admission_order(sched)
    assert sched.kv_cache.num_free_pages == 4


def test_lower_priorities_are_not_starved_once_the_urgent_traffic_stops():
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64, policy="priority")
    for i in range(3):
        sched.add_request(prioritized(f"batch-{i}", 10, max_tokens=6, arrival=float(i)))
    finished_order = []
    for step in range(200):
        if step < 6:  # a burst of urgent requests, one per step
            sched.add_request(prioritized(f"urgent-{step}", 0, max_tokens=3, arrival=10.0 + step))
        if not sched.has_unfinished():
            break
        before = set(sched.requests)
        run_step(sched)
        finished_order += sorted(before - set(sched.requests))
    assert not sched.has_unfinished(), "every request finishes"
    assert {f"batch-{i}" for i in range(3)} <= set(finished_order)
    assert max(finished_order.index(f"urgent-{i}") for i in range(6)) < finished_order.index("batch-2")


def test_priority_is_refused_unless_the_policy_is_priority():
    check_priority(0, "fcfs")
    check_priority(-7, "priority")
    with pytest.raises(InvalidParam, match="--scheduling-policy priority") as e:
        check_priority(3, "fcfs")
    assert e.value.param == "priority"
    with pytest.raises(InvalidParam):
        check_priority(True, "priority")
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="policy"):
        Scheduler(KVCacheManager(8, 4), 1, 8, policy="random")


def test_the_engine_serves_by_priority_and_an_fcfs_engine_refuses_one(llama_dir):
    from jaxserve.llm import LLM
    from tests.engine.helpers import greedy, make_engine, make_prompts

    engine = make_engine(llama_dir, warmup=False, max_num_seqs=1, scheduling_policy="priority")
    prompts = make_prompts(3)
    for name, prompt, priority in zip(("low", "mid", "urgent"), prompts, (5, 0, -1), strict=True):
        engine.add_request(name, prompt, greedy(3), priority=priority)
    first_seen: list[str] = []
    while engine.has_unfinished_requests():
        first_seen += [o.request_id for o in engine.step() if o.request_id not in first_seen]
    assert first_seen == ["urgent", "mid", "low"]

    llm = LLM.__new__(LLM)
    llm.engine, llm._ids = engine, itertools.count()
    outputs = llm.generate(prompts, greedy(3), use_tqdm=False, priority=[3, 2, 1])
    assert [o.prompt_token_ids for o in outputs] == prompts, "outputs in prompt order, whatever ran first"

    fcfs = make_engine(llama_dir, warmup=False)
    with pytest.raises(InvalidParam, match="--scheduling-policy priority"):
        fcfs.add_request("p", prompts[0], greedy(3), priority=2)
    assert not fcfs.has_unfinished_requests()


@pytest.mark.parametrize("k", [4, 8])  # k-step calls within a page of 4 tokens, and longer than one
def test_a_request_that_yields_while_its_k_step_call_runs_resumes_once_the_call_is_read(k):
    """Overlapped k-step calls (async scheduling) with prefix caching: an urgent arrival preempts a request
    whose k-step call is still in flight. The request must not resume in the same plan: its call writes its
    old pages, and a resume under new pages would key them for the prefix cache before they are computed
    (with k over a page, keying past its pages raised)."""
    kv_cache = KVCacheManager(17, 4, enable_prefix_caching=True)  # 16 pages of 4 tokens
    sched = Scheduler(kv_cache, max_num_seqs=4, max_num_batched_tokens=64, num_scheduler_steps=k,
                      policy="priority", overlap_decode_steps=True)
    background = prioritized("background", 1, num_prompt=9, max_tokens=20)
    sched.add_request(background)
    run_step(sched)  # the prefill, read
    in_flight = sched.schedule()  # k steps, not read yet
    replay(sched, in_flight)
    assert list(in_flight.decode_steps) == [k] and background.num_inflight_tokens == k
    sched.add_request(prioritized("urgent", 0, num_prompt=4 * kv_cache.num_free_pages + 4, max_tokens=2))
    plan = sched.schedule()  # launched while the k steps run
    replay(sched, plan)
    assert plan.preempted_ids == ("background",)
    assert "background" not in plan.request_ids, "resumed while its k-step call runs"
    outputs = [StepOutput(in_flight.request_ids, [7], [0.0]) for _ in range(k)]
    sched.update_steps(in_flight, outputs)  # read after the next plan was launched
    sched.update(plan, StepOutput(plan.request_ids, [7] * plan.num_reqs, [0.0] * plan.num_reqs))
    assert background.num_keyed_pages * 4 <= background.num_computed_tokens
    for _ in range(100):  # to the end, each plan read before the next (k-step plans through update_steps)
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        replay(sched, out)
        read = [StepOutput(out.request_ids, [7] * out.num_reqs, [0.0] * out.num_reqs)] * out.num_steps
        sched.update_steps(out, read) if out.is_multi_step else sched.update(out, read[0])
        for request in sched.running:  # every page keyed for the prefix cache holds computed tokens
            assert request.num_keyed_pages * 4 <= request.num_computed_tokens
    assert background.status.is_finished and len(background.output_token_ids) == 20


@pytest.mark.parametrize("budget", [5, 6])
def test_a_request_that_yields_with_one_sample_in_flight_resumes_once_it_is_read(budget):
    """Async scheduling without multi-step: a request whose one sample is still in flight yields to an urgent
    arrival. Resumed in the same plan on new pages, it had its old step's completed pages keyed under the
    new ones when that step was read: past its new page table (an IndexError that killed the engine, with a
    budget of 5) or on pages never computed (6), which a later request with its prefix would have read."""
    kv_cache = KVCacheManager(4, 4, enable_prefix_caching=True)  # 3 usable pages of 4 tokens
    sched = Scheduler(kv_cache, max_num_seqs=4, max_num_batched_tokens=budget, policy="priority")
    background = prioritized("background", 5, num_prompt=7, max_tokens=5)
    sched.add_request(background)
    while background.num_computed_tokens < 7:
        run_step(sched)
    in_flight = sched.schedule()  # its decode, completing its second page, not read yet
    replay(sched, in_flight)
    assert background.num_inflight_tokens == 1
    urgent = dataclasses.replace(make_request("urgent", 8, max_tokens=2), priority=0,
                                 prompt_token_ids=[*background.prompt_token_ids[:4], 9000, 9001, 9002, 9003])
    urgent.num_tokens = len(urgent.prompt_token_ids)
    sched.add_request(urgent)
    plan = sched.schedule()  # launched before the decode is read
    replay(sched, plan)
    assert plan.preempted_ids == ("background",) and "background" not in plan.request_ids
    sched.update(in_flight, StepOutput(in_flight.request_ids, [7], [0.0]))
    sched.update(plan, StepOutput(plan.request_ids, [7] * plan.num_reqs, [0.0] * plan.num_reqs))
    for _ in range(100):
        if not sched.has_unfinished():
            break
        run_step(sched)
        for request in sched.running:  # every page keyed for the prefix cache holds computed tokens
            assert request.num_keyed_pages * 4 <= request.num_computed_tokens
    assert background.status.is_finished and len(background.output_token_ids) == 5
    assert urgent.status.is_finished and len(urgent.output_token_ids) == 2


def test_a_head_waiting_for_an_adapter_slot_makes_nobody_yield():
    """The queue's head waits for a LoRA slot (--max-loras 1, held by a more urgent request). Preempting a
    base-model request frees no slot: it made that request yield, resume in the same plan and recompute
    its context, step after step. Now nothing yields until the head can start."""
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64, policy="priority",
                      max_loras=1)
    holder = dataclasses.replace(prioritized("holder", 0, num_prompt=8, max_tokens=40), lora_id=1)
    base = prioritized("base", 5, num_prompt=8, max_tokens=40, arrival=1.0)
    sched.add_request(holder)
    sched.add_request(base)
    run_step(sched)
    run_step(sched)
    sched.add_request(dataclasses.replace(prioritized("other-adapter", 1, num_prompt=8, max_tokens=4, arrival=2.0),
                                          lora_id=2))
    for _ in range(10):
        out = run_step(sched)
        assert out.preempted_ids == () and sorted(out.request_ids) == ["base", "holder"]
        assert list(out.num_new_tokens) == [1, 1], "decodes, not a recomputed context"
    assert base.num_preemptions == 0


def test_no_yield_when_higher_priority_requests_hold_the_pages_the_head_needs():
    """10 usable pages: R (priority 0) holds 8, L (priority 5) holds 2, none free. H (priority 1) needs 4 pages:
    preempting L frees only 2, so H cannot start until R finishes, whatever L does. L is preempted anyway, sits
    behind H for the rest of R's run (it needed no more pages and would have finished meanwhile), and then
    recomputes its context. Nobody yields when yielding cannot let the head start."""
    sched = Scheduler(KVCacheManager(11, 4, enable_prefix_caching=False), max_num_seqs=4,
                      max_num_batched_tokens=64, policy="priority")
    high = prioritized("R", 0, num_prompt=27, max_tokens=6, arrival=0.0)
    low = prioritized("L", 5, num_prompt=3, max_tokens=6, arrival=1.0)
    sched.add_request(high)
    sched.add_request(low)
    for _ in range(3):
        run_step(sched)
    assert sched.kv_cache.num_free_pages == 0 and len(high.page_ids) == 8 and len(low.page_ids) == 2
    sched.add_request(prioritized("H", 1, num_prompt=16, max_tokens=2, arrival=2.0))
    out = run_step(sched)
    assert "H" not in out.request_ids  # it cannot start: 2 free pages after the yield, it needs 4
    assert out.preempted_ids == (), f"{out.preempted_ids} yielded, yet the head did not start"
    assert low.num_preemptions == 0


def test_no_yield_when_the_token_budget_is_spent_by_higher_priority_requests():
    """max_num_seqs 3, budget 8. Running: R2 (priority 0, finishing), R (priority 0, a 40-token prefill that takes
    the rest of every step's budget), L (priority 5). H (priority 1) arrives: L yields its sequence slot, but R
    spends the budget, so H does not start; R2's slot frees the next step, so when H finally starts (once R's
    prefill ends) it never needed L's slot: L would recompute its 7 tokens for nothing. So L does not yield."""
    sched = Scheduler(KVCacheManager(64, 4, enable_prefix_caching=False), max_num_seqs=3,
                      max_num_batched_tokens=8, policy="priority")
    finishing = prioritized("R2", 0, num_prompt=4, max_tokens=4, arrival=0.0)
    low = prioritized("L", 5, num_prompt=4, max_tokens=30, arrival=1.0)
    sched.add_request(finishing)
    sched.add_request(low)
    run_step(sched)
    run_step(sched)
    sched.add_request(prioritized("R", 0, num_prompt=40, max_tokens=1, arrival=0.5))
    run_step(sched)
    sched.add_request(prioritized("H", 1, num_prompt=4, max_tokens=2, arrival=2.0))
    out = run_step(sched)
    assert "H" not in out.request_ids and sum(out.num_new_tokens) == 8  # the budget went to R2 and R
    assert out.preempted_ids == (), f"{out.preempted_ids} yielded, yet the head did not start"
    admitted_at = None
    for step in range(10):
        out = run_step(sched)
        if "H" in out.request_ids:
            admitted_at = step
            break
    assert admitted_at is not None and finishing.status.is_finished
    assert low.num_preemptions == 0, "L yielded a slot that H never needed (R2's had freed)"


def test_no_yield_when_the_head_fits_after_its_prefix_cache_hit():
    """7 usable pages, one free. H (priority 1) shares R's first 12 tokens (3 keyed pages) and needs one new page:
    it fits as is (the yield counted H's 4 pages without its hit, and preempted L, priority 5)."""
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, policy="priority")
    high = prioritized("R", 0, num_prompt=14, max_tokens=2, arrival=0.0)
    low = prioritized("L", 5, num_prompt=6, max_tokens=2, arrival=1.0)
    sched.add_request(high)
    sched.add_request(low)
    run_step(sched)
    assert kv.num_free_pages == 1 and high.num_keyed_pages == 3
    head = dataclasses.replace(prioritized("H", 1, num_prompt=1, max_tokens=2, arrival=2.0),
                               prompt_token_ids=[*high.prompt_token_ids[:12], 5000, 5001])
    head.num_tokens, head.max_num_tokens = 14, 16
    sched.add_request(head)
    out = run_step(sched)
    assert "H" in out.request_ids and head.num_cached_tokens == 12
    assert out.preempted_ids == (), "L yielded although H fit in the one free page after its hit"


def test_lower_priorities_yield_to_a_request_behind_a_head_waiting_for_an_adapter_slot():
    """max_loras 1 (held by X, priority -1), max_num_seqs 2 (X and L, priority 5). The queue: H1 (adapter 1,
    priority 0: waits for the slot) then H2 (base model, priority 1). The waiting loop lets base-model requests
    pass H1, and L yields to H2 as it would without H1 in the queue (it waited for all 30 of L's tokens)."""
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64, policy="priority",
                      max_loras=1)
    sched.add_request(dataclasses.replace(prioritized("X", -1, num_prompt=4, max_tokens=30), lora_id=2))
    sched.add_request(prioritized("L", 5, num_prompt=4, max_tokens=30, arrival=1.0))
    run_step(sched)
    sched.add_request(dataclasses.replace(prioritized("H1", 0, num_prompt=4, max_tokens=2, arrival=2.0), lora_id=1))
    sched.add_request(prioritized("H2", 1, num_prompt=4, max_tokens=2, arrival=3.0))
    started = set()
    for _ in range(5):
        started |= set(run_step(sched).request_ids)
    assert "H2" in started, "a priority-1 request waited behind priority 5 for five steps"
