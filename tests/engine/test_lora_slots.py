"""LoRA in the scheduler (pure Python): which adapter holds which device slot, who may start while a slot is
taken, and the prefix-cache keys of adapters."""

import pytest

from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.lora_slots import LoraSlots
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.step_io import NO_LORA_SLOT
from tests.engine.test_scheduler import make_request, run_step


def test_requests_of_one_adapter_share_its_slot_and_others_take_free_ones():
    slots = LoraSlots(2)
    assert slots.acquire(1) == slots.acquire(1) == 0
    assert slots.acquire(2) == 1
    assert not slots.can_take(3) and slots.can_take(1)
    with pytest.raises(RuntimeError):
        slots.acquire(3)
    assert slots.running_adapters == [1, 2]


def test_a_slot_frees_when_its_last_request_leaves_and_keeps_its_adapter_until_taken():
    slots = LoraSlots(2)
    a, b = slots.acquire(1), slots.acquire(2)
    slots.acquire(1)
    slots.release(a)
    assert not slots.can_take(3)  # 1 has a request left
    slots.release(a)
    assert slots.running_adapters == [2]
    assert slots.acquire(1) == a  # still there: no write
    slots.release(a)
    slots.release(b)
    slots.release(NO_LORA_SLOT)  # a base-model request holds none
    assert slots.acquire(3) == a  # freed longest ago
    assert slots.acquire(2) == b


def test_never_used_slots_go_first():
    slots = LoraSlots(3)
    slots.release(slots.acquire(1))
    assert slots.acquire(2) == 1 and slots.acquire(3) == 2 and slots.acquire(4) == 0


def _lora_request(request_id: str, lora_id: int | None) -> Request:
    request = make_request(request_id, 4, max_tokens=3)
    request.lora_id = lora_id
    return request


def test_the_scheduler_runs_at_most_max_loras_adapters_and_lets_base_requests_pass():
    """With one slot: adapter 1 runs; a request of adapter 2 waits for the slot at the queue's head; a
    base-model request behind it starts; a request of adapter 1 behind it does not (its slot must free).
    Once adapter 1's requests end, adapter 2 takes the slot, in queue order again."""
    scheduler = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, max_loras=1)
    for request in (_lora_request("a1", 1), _lora_request("b2", 2), _lora_request("base", None),
                    _lora_request("a1-late", 1)):
        scheduler.add_request(request)
    first = run_step(scheduler)
    assert first.request_ids == ["a1", "base"]
    assert [new.lora_slot for new in first.new_requests] == [0, NO_LORA_SLOT]
    assert [new.lora_id for new in first.new_requests] == [1, None]
    assert [r.request_id for r in scheduler.waiting] == ["b2", "a1-late"]
    assert scheduler.lora_slots.running_adapters == [1]
    started = []
    while scheduler.has_unfinished():
        started += [new.request_id for new in run_step(scheduler).new_requests]
        assert len(scheduler.lora_slots.running_adapters) <= 1
    assert started == ["b2", "a1-late"]


def test_slots_come_back_on_preemption_and_abort():
    scheduler = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, max_loras=1)
    scheduler.add_request(_lora_request("a", 1))
    run_step(scheduler)
    scheduler._preempt(scheduler.running.pop())
    assert scheduler.lora_slots.running_adapters == [] and scheduler.waiting[0].lora_slot == NO_LORA_SLOT
    run_step(scheduler)
    assert scheduler.lora_slots.running_adapters == [1]
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.lora_slots.running_adapters == [] and scheduler.lora_slots.can_take(2)


def test_prefix_cache_keys_keep_salts_and_adapters_apart():
    """A salt cannot pose as an adapter: every (salt, adapter) pair keys its own pages."""
    keys = {(salt, lora_id): _lora_request("r", lora_id) for salt in (None, "x", '[null, 1]', "\0lora\x001")
            for lora_id in (None, 1, 2)}
    for (salt, _), request in keys.items():
        request.cache_salt = salt
    salts = [request.prefix_cache_salt for request in keys.values()]
    assert salts[0] is None and len(set(salts)) == len(salts)
