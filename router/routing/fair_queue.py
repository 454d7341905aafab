"""A bounded queue that is fair between keys (API keys): one FIFO per key, served weighted
round robin (a key of weight w is served up to w times in a row before the next key's
turn; unlisted keys weigh 1), so that one client's burst cannot starve another's single
request; when it is full, a key holding fewer places than its weighted share takes the
newest place of the key furthest over its share (`evict_for`), so no key can fill every
place. Used by router/routing/admission.py to hold requests at the ingress, one FairQueue
per priority band (BandedQueue)."""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import Any


class FairQueue:
    """Held requests, one FIFO per API key, served weighted round robin between keys;
    bounded in total. O(1) push and pop."""

    def __init__(self, capacity: int, weights: Mapping[str, int] | None = None) -> None:
        if weights and min(weights.values()) < 1:
            raise ValueError(f"key weights must be >= 1, got {dict(weights)}")
        self.capacity = capacity
        self.weights: Mapping[str, int] = weights or {}
        self._by_key: OrderedDict[str, deque[Any]] = OrderedDict()
        self._served: dict[str, int] = {}  # turns a key has had in a row (it moves back at its weight)
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
        """Remove the next item; its key goes to the back of the rotation once it has been
        served its weight's turns in a row."""
        return self.pop_key(next(iter(self._by_key)))

    def heads(self) -> list[tuple[str, Any]]:
        """Every key's head, in rotation order (the key whose turn it is first)."""
        return [(key, items[0]) for key, items in self._by_key.items()]

    def pop_key(self, key: str) -> Any:
        """Remove `key`'s head; the key keeps its place until it has been served its
        weight's turns in a row, then goes to the back of the rotation (the other keys go
        first)."""
        items = self._by_key[key]
        item = items.popleft()
        self._len -= 1
        served = self._served.get(key, 0) + 1
        if items and served < self.weights.get(key, 1):
            self._served[key] = served
            return item
        self._served.pop(key, None)
        del self._by_key[key]
        if items:
            self._by_key[key] = items  # re-inserted last
        return item

    def evict_for(self, key: str) -> Any | None:
        """When full: remove and return the newest item of the deepest key, if that key
        holds more than one place beyond what `key` would hold with one more; else None
        (the queue is fair already: `key` is the one to refuse)."""
        if self._len < self.capacity:
            return None
        return self.take_newest_of_deepest((self.depth(key) + 1) / self.weights.get(key, 1))

    def take_newest_of_deepest(self, than_depth: float) -> Any | None:
        """Remove and return the newest item of the key deepest for its weight (places held
        over weight) when that depth is more than `than_depth`; else None."""
        if not self._by_key:
            return None
        # Ties: the key last in the rotation (the newest to queue), so the newest work goes.
        deepest, items = max(reversed(self._by_key.items()), key=lambda entry: self._share_depth(entry[0]))
        if self._share_depth(deepest) <= than_depth:
            return None
        item = items.pop()
        if not items:
            del self._by_key[deepest]
            self._served.pop(deepest, None)
        self._len -= 1
        return item

    def remove(self, key: str, item: Any) -> bool:
        """Remove `item` itself (by identity: two waiters with equal fields, the same prompt
        sent twice, are two places, and comparing them field by field would walk their
        token lists)."""
        items = self._by_key.get(key)
        index = next((i for i, queued in enumerate(items or ()) if queued is item), None)
        if items is None or index is None:
            return False
        del items[index]
        if not items:
            del self._by_key[key]
            self._served.pop(key, None)
        self._len -= 1
        return True

    def depth(self, key: str) -> int:
        items = self._by_key.get(key)
        return len(items) if items else 0

    def _share_depth(self, key: str) -> float:
        """Places held per unit of weight: equal across keys when each holds its share."""
        return self.depth(key) / self.weights.get(key, 1)


class BandedQueue:
    """FairQueues by priority band (lower value first), bounded together: every head of a
    better band is offered before any of a worse band; when full, a newcomer takes the
    newest place of the worst band if that band is worse than its own, else of the deepest
    key of its own band (FairQueue.evict_for's rule), else it is refused."""

    def __init__(self, capacity: int, weights: Mapping[str, int] | None = None) -> None:
        self.capacity = capacity
        self.weights = weights or {}
        self._bands: dict[int, FairQueue] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, band: int, key: str, item: Any) -> bool:
        if self._len >= self.capacity:
            return False
        queue = self._bands.get(band)
        if queue is None:
            queue = self._bands[band] = FairQueue(self.capacity, self.weights)
        queue.push(key, item)
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
            queue = self._bands[band]
            item, better = queue.take_newest_of_deepest((queue.depth(key) + 1) / self.weights.get(key, 1)), False
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
