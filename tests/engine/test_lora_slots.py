"""LoraSlots: which adapter holds which device slot (pure Python)."""

import pytest

from jaxserve.engine.lora_slots import LoraSlots
from jaxserve.engine.step_io import NO_LORA_SLOT


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
