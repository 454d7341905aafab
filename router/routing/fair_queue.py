"""A bounded queue that is fair between keys (API keys): one FIFO per key, served round
robin, so that one client's burst cannot starve another's single request; when it is full,
a key holding fewer places than the deepest key takes that key's newest place
(`evict_for`), so no key can fill every place. Used by router/routing/admission.py to hold
requests at the ingress."""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any


class FairQueue:
    """Held requests, one FIFO per API key, served round robin between keys; bounded in
    total. O(1) push and pop."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_key: OrderedDict[str, deque[Any]] = OrderedDict()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, key: str, item: Any) -> bool:
        """False (nothing added) when the queue is full."""
        if self._len >= self.capacity:
            return False
        self._by_key.setdefault(key, deque()).append(item)
        self._len += 1
        return True

    def peek(self) -> Any | None:
        """The next item round robin: the head of the key whose turn it is."""
        for items in self._by_key.values():
            return items[0]
        return None

    def pop(self) -> Any:
        """Remove the next item; its key goes to the back of the rotation."""
        key, items = next(iter(self._by_key.items()))
        item = items.popleft()
        del self._by_key[key]
        if items:
            self._by_key[key] = items  # re-inserted last: the other keys go first
        self._len -= 1
        return item

    def heads(self) -> list[tuple[str, Any]]:
        """Every key's head, in rotation order (the key whose turn it is first)."""
        return [(key, items[0]) for key, items in self._by_key.items()]

    def pop_key(self, key: str) -> Any:
        """Remove `key`'s head; the key goes to the back of the rotation."""
        items = self._by_key.pop(key)
        item = items.popleft()
        if items:
            self._by_key[key] = items
        self._len -= 1
        return item

    def evict_for(self, key: str) -> Any | None:
        """When full: remove and return the newest item of the deepest key, if that key
        holds more than one place beyond what `key` would hold with one more; else None
        (the queue is fair already: `key` is the one to refuse)."""
        if self._len < self.capacity or not self._by_key:
            return None
        deepest, items = max(self._by_key.items(), key=lambda entry: len(entry[1]))
        if len(items) <= self.depth(key) + 1:
            return None
        item = items.pop()
        if not items:
            del self._by_key[deepest]
        self._len -= 1
        return item

    def remove(self, key: str, item: Any) -> bool:
        items = self._by_key.get(key)
        if items is None or item not in items:
            return False
        items.remove(item)
        if not items:
            del self._by_key[key]
        self._len -= 1
        return True

    def depth(self, key: str) -> int:
        items = self._by_key.get(key)
        return len(items) if items else 0
