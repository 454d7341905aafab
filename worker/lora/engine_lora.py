"""The engine's side of multi-LoRA: which adapter a request uses, its host load, and its
device slot (torch-free: the runner writes the weights).

A request's life with an adapter:
    add_request  -> pin (host load starts off the step thread)  -> waits here until loaded
    loaded       -> the scheduler's waiting queue; admitted when its adapter has a slot
    finished / aborted / failed -> unpin (the host LRU may drop the adapter again)
Its prefix-cache chain starts from a root keyed by the adapter (name and reference: its
directory and content digest, worker/lora/identity.py): KV computed under one adapter, or
under an adapter's former files, is never served to another, nor to the base model.
"""
from __future__ import annotations

from concurrent.futures import Executor, Future
from typing import Any

from worker.api import lora_cache_key
from worker.config import LoRAConfig
from worker.lora.identity import confine
from worker.lora.registry import Loader, LoRARegistry
from worker.lora.slots import LoRASlots
from worker.sequence import Sequence
from worker.api import LoRAAdapterError


class EngineLoRA:
    def __init__(self, config: LoRAConfig, loader: Loader, executor: Executor | None = None) -> None:
        self.config = config
        self.registry = LoRARegistry(loader, config.host_capacity, executor)
        self.slots = LoRASlots(config.max_loras)
        for name, path in config.modules:
            self.registry.register(name, path)
        self._loading: list[tuple[Sequence, Future[Any]]] = []

    def cache_key(self, name: str) -> str:
        """The adapter's extra key on a request's block-hash chain (kv/block_hash.py)."""
        return lora_cache_key(name, self.registry.paths[name])

    def add(self, seq: Sequence) -> bool:
        """Pin the request's adapter; True when it is loaded in host memory already (the
        request may enter the scheduler now), else it waits here."""
        future = self.registry.pin(seq.lora_name)  # type: ignore[arg-type]
        if future.done() and future.exception() is None:
            return True
        self._loading.append((seq, future))
        return False

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    def take_loaded(self) -> tuple[list[Sequence], list[tuple[Sequence, str]]]:
        """The waiting requests whose adapter load finished: (ready, failed with message)."""
        ready, failed, still = [], [], []
        for seq, future in self._loading:
            if not future.done():
                still.append((seq, future))
            elif future.exception() is not None:
                failed.append((seq, str(future.exception())))
            else:
                ready.append(seq)
        self._loading = still
        return ready, failed

    def is_loading(self, seq: Sequence) -> bool:
        return any(s is seq for s, _ in self._loading)

    def futures(self) -> list[Future[Any]]:
        return [f for _, f in self._loading]

    def done(self, seq: Sequence) -> None:
        """The request ended (any way): unpin its adapter."""
        if seq.lora_name is None:
            return
        self._loading = [(s, f) for s, f in self._loading if s is not seq]
        self.registry.unpin(seq.lora_name)
        seq.lora_name = None  # unpinned once, however many end paths it takes

    def ensure(self, name: str, path: str) -> None:
        """A request names the adapter with its path: learn it, or its new path."""
        if self.registry.paths.get(name) != path:
            self.register(name, path)

    def resolve(self, name: str, path: str | None) -> None:
        """A request's adapter: learned from `path` when given, else it must be known
        (LoRANotFoundError)."""
        if path is not None:
            self.ensure(name, path)
        self.registry.check(name)

    def check(self, name: str, path: str, roots: tuple[str, ...] = ()) -> tuple[str, str]:
        """Read an adapter as a request would (any thread: nothing shared is touched);
        raises LoRAAdapterError with what is wrong with it. With `roots`, the directory must
        resolve inside one of them (worker/lora/identity.py confine). Returns (the resolved
        directory, the digest of its files; "" where the loader computes none)."""
        if roots:
            path = confine(path, roots)
        adapter = self.registry.load(name, path)
        return path, str(getattr(adapter, "digest", ""))

    def unload(self, name: str) -> bool:
        """The ingress unloaded `name`: forget it, its host copy and its device slot (the ones
        running requests still hold are dropped when they end). False: not known here."""
        if name not in self.registry.paths:
            return False
        self.registry.unregister(name)
        self.slots.evict(name)
        return True

    def register(self, name: str, path: str) -> None:
        """Make an adapter known. A name reused for another path must not find the old
        weights in a slot or in host memory."""
        if self.registry.paths.get(name) != path:
            if self.registry.in_use(name) or not self.slots.evict(name):
                raise LoRAAdapterError(f"the LoRA adapter {name!r} still serves requests under its former path; "
                                       f"retry when they end")
            if name in self.registry.paths:
                self.registry.unregister(name)
        self.registry.register(name, path)
