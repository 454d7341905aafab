"""The adapters a worker knows (name -> PEFT directory) and the LRU of those loaded in host
memory (`max_cpu_loras`). Loads run on a thread of their own, never on the step thread:
a request whose adapter is not in host memory waits outside the scheduler until its load
is done (worker/scheduling/requests.py, Requests.admit_ready).

An adapter that a waiting or running request uses is *pinned*: the LRU never drops it, so
the scheduler always finds its weights when it gives it a device slot (the LRU may then
hold more than its capacity until requests finish).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from worker.api import LoRAAdapterError, LoRANotFoundError

Loader = Callable[[str, str], Any]  # (name, path) -> the loaded adapter (worker/lora/adapter.py)


class LoRARegistry:
    def __init__(self, loader: Loader, host_capacity: int, executor: Executor | None = None) -> None:
        """`executor`: where host loads run (default: one thread of their own; the simulator
        passes one that completes them on its virtual clock)."""
        self._loader = loader
        self.host_capacity = host_capacity
        self.paths: dict[str, str] = {}
        self._loaded: OrderedDict[str, Future[Any]] = OrderedDict()  # LRU, most recent last
        self._pins: dict[str, int] = {}
        self._pool = executor or ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self.num_host_loads = 0

    @property
    def names(self) -> list[str]:
        return sorted(self.paths)

    def check(self, name: str) -> None:
        if name not in self.paths:
            raise LoRANotFoundError(name, list(self.paths))

    def register(self, name: str, path: str) -> None:
        if self.paths.get(name, path) != path:
            raise LoRAAdapterError(f"the LoRA adapter {name!r} is already loaded from {self.paths[name]}; "
                                   f"unload it first")
        self.paths[name] = path

    def unregister(self, name: str) -> None:
        self.check(name)
        del self.paths[name]
        if not self._pins.get(name):
            self._loaded.pop(name, None)

    def load(self, name: str, path: str) -> Any:
        """Read an adapter in the caller's thread (the load API: a bad file must fail the
        call itself), without registering it."""
        return self._loader(name, path)

    def pin(self, name: str) -> Future[Any]:
        """A request uses `name`: start its host load if needed; the future resolves to the
        adapter (or its LoRAAdapterError). Unpin when the request ends."""
        self.check(name)
        self._pins[name] = self._pins.get(name, 0) + 1
        future = self._loaded.get(name)
        if future is None or (future.done() and future.exception() is not None):
            future = self._pool.submit(self._loader, name, self.paths[name])
            self._loaded[name] = future
            self.num_host_loads += 1
        self._loaded.move_to_end(name)
        self._shrink()
        return future

    def in_use(self, name: str) -> bool:
        return bool(self._pins.get(name))

    def unpin(self, name: str) -> None:
        self._pins[name] -= 1
        if not self._pins[name]:
            del self._pins[name]
            if name not in self.paths:  # unloaded while in use
                self._loaded.pop(name, None)
        self._shrink()

    def get(self, name: str) -> Any:
        """The loaded adapter of a pinned, loaded name."""
        return self._loaded[name].result()

    @property
    def host_resident(self) -> list[str]:
        loaded = list(self._loaded.items())  # one C-level copy: the engine thread edits the LRU
        return [n for n, f in loaded if f.done() and f.exception() is None]

    def _shrink(self) -> None:
        over = len(self._loaded) - self.host_capacity
        for name in list(self._loaded):
            if over <= 0:
                break
            if not self._pins.get(name):
                del self._loaded[name]
                over -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
