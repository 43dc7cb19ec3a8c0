"""Which LoRA adapter holds which of the device's adapter slots (`--max-loras`): the scheduler's, pure Python.

A running request of an adapter holds its adapter's slot, which keeps that adapter until no running request
uses it. A request of an adapter without a slot takes a free one (no running request uses it): one never
used first, else the one freed longest ago. A freed slot keeps its adapter until then, so requests that
come back to it find it in place: the runner writes a slot only when the adapter in it changes.
"""

from jaxserve.engine.step_io import NO_LORA_SLOT


class LoraSlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._adapter: list[str | None] = [None] * max_loras  # what each slot holds
        self._users = [0] * max_loras  # running requests using each slot
        self._freed_at = [-1] * max_loras  # when each slot's last user left (-1: never used)
        self._clock = 0

    def can_take(self, name: str) -> bool:
        """Whether a request of adapter `name` can start now: its adapter holds a slot, or a slot is free."""
        return name in self._adapter or 0 in self._users

    def acquire(self, name: str) -> int:
        """The slot of adapter `name` for a starting request (its own, else a free one it now holds)."""
        if name in self._adapter:
            slot = self._adapter.index(name)
        else:
            free = [slot for slot in range(self.max_loras) if not self._users[slot]]
            if not free:
                raise RuntimeError(f"no free LoRA slot for {name!r}: the scheduler asks can_take first")
            slot = min(free, key=self._freed_at.__getitem__)
            self._adapter[slot] = name
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
    def running_adapters(self) -> list[str]:
        """The adapters running requests use (vLLM's running_lora_adapters)."""
        return sorted(name for name, users in zip(self._adapter, self._users, strict=True) if users and name)
