"""Which adapter sits in which of the `max_loras` device slots (plain Python, torch-free).

A slot is *held* while a running sequence uses its adapter (a reference count); an
unheld slot keeps its adapter resident until it is needed for another one, the least
recently released first. The scheduler asks `can_acquire` before it admits a sequence,
then `acquire`s (with its blocks); preemption and finishing `release`.

    slots:   [ "sql" (2 refs) | "chat" (0 refs, evictable) | empty | empty ]
    acquire("math") -> slot 2 (an empty slot before an evictable one), needs a load
"""
from __future__ import annotations

from collections import OrderedDict


class LoRASlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: dict[str, int] = {}
        self._name_of: list[str | None] = [None] * num_slots
        self._refs = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # empty slots, lowest id popped first
        self._idle: OrderedDict[int, None] = OrderedDict()  # resident, unheld: eviction order
        self.num_loads = 0

    def slot_of(self, name: str) -> int | None:
        return self._slot_of.get(name)

    @property
    def resident(self) -> list[str]:
        """The adapters in slots, by slot id."""
        return [n for n in list(self._name_of) if n is not None]

    @property
    def active(self) -> list[str]:
        """The adapters in held slots (a running sequence uses each), by slot id."""
        return [n for n, refs in zip(list(self._name_of), list(self._refs)) if n is not None and refs]

    def can_acquire(self, name: str) -> bool:
        return name in self._slot_of or bool(self._free) or bool(self._idle)

    def acquire(self, name: str) -> tuple[int, bool]:
        """A reference on `name`'s slot: (slot, whether the adapter must be written into it
        before the step runs). Call only after can_acquire."""
        slot = self._slot_of.get(name)
        load = slot is None
        if slot is None:
            if self._free:
                slot = self._free.pop()
            else:
                slot, _ = self._idle.popitem(last=False)
                del self._slot_of[self._name_of[slot]]  # type: ignore[index]
            self._slot_of[name] = slot
            self._name_of[slot] = name
            self.num_loads += 1
        elif self._refs[slot] == 0:
            del self._idle[slot]
        self._refs[slot] += 1
        return slot, load

    def release(self, slot: int) -> None:
        self._refs[slot] -= 1
        assert self._refs[slot] >= 0
        if self._refs[slot] == 0:
            self._idle[slot] = None

    def evict(self, name: str) -> bool:
        """Drop an unheld adapter (it was unloaded); False while a sequence holds it."""
        slot = self._slot_of.get(name)
        if slot is None:
            return True
        if self._refs[slot]:
            return False
        del self._slot_of[name], self._idle[slot]
        self._name_of[slot] = None
        self._free.append(slot)
        self._free.sort(reverse=True)
        return True
