"""Which LoRA adapter (by its id) holds which of the device's adapter slots (`--max-loras`): the scheduler's,
pure Python.

A running request of an adapter holds its adapter's slot, which keeps that adapter until no running request
uses it. A request of an adapter without a slot takes a free one (no running request uses it): one never
used first, else the one freed longest ago. A freed slot keeps its adapter until then, so requests that
come back to it find it in place: the runner writes a slot only when the adapter in it changes.
"""

from jaxserve.engine.step_io import NO_LORA_SLOT


class LoraSlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._adapter: list[int | None] = [None] * max_loras  # what each slot holds
        self._users = [0] * max_loras  # running requests using each slot
        self._freed_at = [-1] * max_loras  # when each slot's last user left (-1: never used)
        self._clock = 0

    def can_take(self, lora_id: int) -> bool:
        """Whether a request of adapter `lora_id` can start now: its adapter holds a slot, or a slot is free."""
        return lora_id in self._adapter or 0 in self._users

    def acquire(self, lora_id: int) -> int:
        """The slot of adapter `lora_id` for a starting request (its own, else a free one it now holds)."""
        if lora_id in self._adapter:
            slot = self._adapter.index(lora_id)
        else:
            free = [slot for slot in range(self.max_loras) if not self._users[slot]]
            if not free:
                raise RuntimeError(f"no free LoRA slot for {lora_id!r}: the scheduler asks can_take first")
            slot = min(free, key=self._freed_at.__getitem__)
            self._adapter[slot] = lora_id
        self._users[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        """A request holding `slot` stopped running (finished, aborted or preempted)."""
        if slot == NO_LORA_SLOT:
            return
        self._users[slot] -= 1
        if not self._users[slot]:
            self._clock += 1
            self._freed_at[slot] = self._clock

    @property
    def running_adapters(self) -> list[int]:
        """The adapters running requests use (vLLM's running_lora_adapters)."""
        return sorted(lora_id for lora_id, users in zip(self._adapter, self._users, strict=True) if users)
