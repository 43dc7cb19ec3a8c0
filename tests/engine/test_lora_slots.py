"""LoraSlots: which adapter holds which device slot (pure Python)."""

import pytest

from jaxserve.engine.lora_slots import LoraSlots
from jaxserve.engine.step_io import NO_LORA_SLOT


def test_requests_of_one_adapter_share_its_slot_and_others_take_free_ones():
    slots = LoraSlots(2)
    assert slots.acquire("a") == slots.acquire("a") == 0
    assert slots.acquire("b") == 1
    assert not slots.can_take("c") and slots.can_take("a")
    with pytest.raises(RuntimeError):
        slots.acquire("c")
    assert slots.running_adapters == ["a", "b"]


def test_a_slot_frees_when_its_last_request_leaves_and_keeps_its_adapter_until_taken():
    slots = LoraSlots(2)
    a, b = slots.acquire("a"), slots.acquire("b")
    slots.acquire("a")
    slots.release(a)
    assert not slots.can_take("c")  # "a" has a request left
    slots.release(a)
    assert slots.running_adapters == ["b"]
    assert slots.acquire("a") == a  # still there: no write
    slots.release(a)
    slots.release(b)
    slots.release(NO_LORA_SLOT)  # a base-model request holds none
    assert slots.acquire("c") == a  # freed longest ago
    assert slots.acquire("b") == b


def test_never_used_slots_go_first():
    slots = LoraSlots(3)
    slots.release(slots.acquire("a"))
    assert slots.acquire("b") == 1 and slots.acquire("c") == 2 and slots.acquire("d") == 0
