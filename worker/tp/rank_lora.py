"""LoRA adapters on a tensor-parallel rank other than 0: the host copies its slot writes
read from.

Rank 0's registry decides which adapters are loaded (worker/lora/registry.py); its loader
reads an adapter on rank 0 and then has every other rank read it too (`load`, on the
rank actor's second thread, while its step loop runs), before any request of that
adapter can be admitted. A plan's slot write (plan_codec's lora loads) then finds the
adapter here. Each rank keeps full adapters and writes its own shard of them into its
slots (worker/lora/layers.py: a column-parallel layer takes its rows of B, a row-parallel
one its columns of A).

The store holds at most `capacity` adapters (least recently loaded dropped first), as
rank 0's host LRU does. Rank 0 may keep more (it never drops one a request still uses);
a slot write whose adapter was dropped here reads it again on the step, from the path
that rank 0 sent: slower, never wrong.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class RankLoRAStore:
    def __init__(self, loader: Callable[[str, str], Any], capacity: int) -> None:
        self._loader = loader
        self.capacity = capacity
        self._adapters: OrderedDict[str, Any] = OrderedDict()  # most recently loaded last
        self._paths: dict[str, str] = {}  # every adapter ever named: where to read it again
        self._lock = threading.Lock()  # `load` runs beside the step thread's `get`

    def load(self, name: str, path: str) -> None:
        """Read `name` from `path` (raises the loader's LoRAAdapterError)."""
        with self._lock:
            held = self._adapters.get(name)
        if held is None or held.path != path:
            held = self._loader(name, path)
        with self._lock:
            self._paths[name] = path
            self._adapters[name] = held
            self._adapters.move_to_end(name)
            while len(self._adapters) > self.capacity:
                self._adapters.popitem(last=False)

    def get(self, name: str) -> Any:
        """The adapter a slot write needs (read again if it was dropped)."""
        with self._lock:
            held = self._adapters.get(name)
            path = self._paths.get(name)
        if held is not None:
            return held
        if path is None:
            raise KeyError(f"LoRA adapter {name!r} was never loaded on this rank")
        logger.info("LoRA adapter %s was dropped from this rank's host memory; reading it again", name)
        self.load(name, path)
        return self.get(name)
