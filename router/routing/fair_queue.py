"""A bounded queue that is fair between keys (API keys): one FIFO per key, served round
robin, so that one client's burst cannot starve another's single request; when it is full,
a key holding fewer places than the deepest key takes that key's newest place
(`evict_for`), so no key can fill every place. Used by router/routing/admission.py to hold
requests at the ingress, one FairQueue per priority band (BandedQueue)."""
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
        if self._len < self.capacity:
            return None
        return self.take_newest_of_deepest(self.depth(key) + 1)

    def take_newest_of_deepest(self, than_depth: int) -> Any | None:
        """Remove and return the newest item of the deepest key when it holds more than
        `than_depth` items; else None."""
        if not self._by_key:
            return None
        # Ties: the key last in the rotation (the newest to queue), so the newest work goes.
        deepest, items = max(reversed(self._by_key.items()), key=lambda entry: len(entry[1]))
        if len(items) <= than_depth:
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


class BandedQueue:
    """FairQueues by priority band (lower value first), bounded together: every head of a
    better band is offered before any of a worse band; when full, a newcomer takes the
    newest place of the worst band if that band is worse than its own, else of the deepest
    key of its own band (FairQueue.evict_for's rule), else it is refused."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._bands: dict[int, FairQueue] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, band: int, key: str, item: Any) -> bool:
        if self._len >= self.capacity:
            return False
        self._bands.setdefault(band, FairQueue(self.capacity)).push(key, item)
        self._len += 1
        return True

    def heads(self) -> list[tuple[int, str, Any]]:
        """Every (band, key)'s head: best band first, each band in its rotation order."""
        return [(band, key, item) for band in sorted(self._bands) for key, item in self._bands[band].heads()]

    def pop_key(self, band: int, key: str) -> Any:
        item = self._bands[band].pop_key(key)
        self._after_removal(band)
        return item

    def evict_for(self, band: int, key: str) -> tuple[Any, bool] | None:
        """When full: (the evicted item, whether for a better band) or None (refuse the
        newcomer)."""
        if self._len < self.capacity or not self._bands:
            return None
        worst = max(self._bands)
        if worst > band:
            item, better = self._bands[worst].take_newest_of_deepest(0), True
        elif worst == band:
            item, better = self._bands[band].take_newest_of_deepest(self._bands[band].depth(key) + 1), False
        else:
            return None
        if item is None:
            return None
        self._after_removal(worst if better else band)
        return item, better

    def remove(self, band: int, key: str, item: Any) -> bool:
        queue = self._bands.get(band)
        if queue is None or not queue.remove(key, item):
            return False
        self._after_removal(band)
        return True

    def depth(self, key: str) -> int:
        return sum(queue.depth(key) for queue in self._bands.values())

    def _after_removal(self, band: int) -> None:
        self._len -= 1
        if not len(self._bands[band]):
            del self._bands[band]
