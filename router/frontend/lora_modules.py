"""The LoRA adapters this ingress serves, by the name clients send as `model`, and vLLM's
load/unload endpoints' logic (POST /v1/load_lora_adapter, /v1/unload_lora_adapter).

Every engine request names its adapter *with its reference* (GenerateRequest.lora_path:
its directory and the digest of its files, worker/lora/identity.py), so any worker
replica serves any adapter the ingress knows, a replica started after the adapter was
loaded included: it reads the adapter on its first request (worker/lora/), and refuses
files whose digest is not the reference's. A load is checked by one worker replica first
(the directory confined to the configured roots, the whole adapter read against the
model), so a bad adapter is a 400 at load and never reaches a request.

Run-time updates (router/frontend/lora_policy.py) are off unless configured and take an
admin key (the ingress checks the key; this class the policy). Loads are bounded: the
name's length, the number of adapters, the loads checked at once (429 beyond), a timeout
(504); concurrent loads of one name share one check.

With a shared registry (cluster/lora_registry.py, Redis when `state.redis_url` is set) the
run-time adapters are the cluster's, not this replica's: a load or unload through any
ingress replica is written there, and every replica re-reads the list (when its version
moved) before it resolves a name it does not know, or one it read more than
REFRESH_S ago. So a replica that restarts serves what was loaded before, and an unload
through one replica stops the others within REFRESH_S. The configured adapters
(`lora.modules`) are every replica's own and cannot be unloaded from another.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from router import errors
from router.frontend.lora_policy import MAX_LORA_NAME_CHARS, LoRAPolicy
from worker.lora.identity import make_ref, read_adapter_files

# (name, directory, roots) -> (resolved directory, content digest): a worker replica's check.
Check = Callable[[str, str, tuple[str, ...]], Awaitable[tuple[str, str]]]
# A configured adapter's files are read at start-up (for its digest) up to this size each.
_STARTUP_DIGEST_MAX_BYTES = 2 * 1024**3
# How stale a known name's entry may be before a request re-reads the shared registry.
REFRESH_S = 1.0

logger = logging.getLogger(__name__)


class AdapterRegistry(Protocol):
    """The run-time adapters shared by every ingress replica (cluster/lora_registry.py)."""

    async def version(self) -> int: ...

    async def snapshot(self) -> tuple[int, dict[str, tuple[str, str]]]: ...

    async def add(self, name: str, path: str, ref: str, max_adapters: int) -> str: ...

    async def remove(self, name: str) -> bool: ...


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=4096)
    # The served model the adapter is for, where the ingress serves several (kvserve's own
    # field; None: the first model).
    base_model: str | None = Field(None, min_length=1, max_length=MAX_LORA_NAME_CHARS)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)
    lora_path: str | None = Field(None, max_length=4096)  # accepted as vLLM does; the name decides


@dataclass(frozen=True)
class Adapter:
    """A served adapter: its directory (shown to admin keys only) and its reference (the
    directory with its content digest: what requests and hash roots carry)."""

    path: str
    ref: str


def startup_ref(path: str) -> str:
    """A configured adapter's reference: with its digest when this process can read its
    files, else the bare directory (its workers then key it by directory only)."""
    try:
        return make_ref(path, read_adapter_files(path, _STARTUP_DIGEST_MAX_BYTES).digest)
    except Exception:  # noqa: BLE001 -- unreadable here (another node's disk): the worker decides at load
        return path


class LoRAModules:
    def __init__(self, base_model: str, modules: tuple[tuple[str, str], ...], enabled: bool,
                 policy: LoRAPolicy | None = None, registry: AdapterRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.base_model = base_model
        self.policy = policy or LoRAPolicy()
        self._configured = {name: Adapter(path, startup_ref(path)) for name, path in modules}
        self.adapters: dict[str, Adapter] = dict(self._configured)
        self.enabled = enabled or bool(modules)
        self._loads: dict[str, asyncio.Future[str]] = {}  # name -> the load under way
        self.registry = registry
        self._clock = clock
        self._version = -1  # the registry version self.adapters reflects
        self._read_at = -float("inf")

    async def refresh(self, model: str | None = None) -> None:
        """Re-read the shared registry when `model` is a name not known here, or the last
        read is older than REFRESH_S (module docstring; None: the whole list, for listing
        it); a no-op without one. Redis unreachable: the list read last stays (logged)."""
        if self.registry is None or model == self.base_model or (model and model in self._configured):
            return
        if (model is None or model in self.adapters) and self._clock() - self._read_at < REFRESH_S:
            return
        await self._sync()

    async def _sync(self) -> None:
        assert self.registry is not None
        try:
            if await self.registry.version() != self._version:
                self._version, shared = await self.registry.snapshot()
                self.adapters = {**{n: Adapter(p, r) for n, (p, r) in shared.items()}, **self._configured}
            self._read_at = self._clock()
        except Exception as e:  # noqa: BLE001 -- any client error: keep serving what was read last
            logger.warning("the shared adapter registry is unreachable (%s); serving the list read last",
                           type(e).__name__)

    @property
    def paths(self) -> dict[str, str]:
        """name -> directory (for admin views)."""
        return {name: a.path for name, a in self.adapters.items()}

    def resolve(self, model: str | None) -> tuple[str, str] | None:
        """The adapter (name, reference) a request's `model` picks; None: the base model.
        An unknown name is a 404 that lists the known ones."""
        if not model or model == self.base_model:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            raise not_found(model, [self.base_model, *sorted(self.adapters)])
        return model, adapter.ref

    def _check_updates_allowed(self) -> None:
        if not self.enabled:
            raise errors.bad_request("This server does not serve LoRA adapters; start it with lora.enable "
                                     "(--enable-lora) or lora.modules (--lora-modules).", "lora_name")
        if not self.policy.runtime_updates:
            raise errors.APIError(403, "Run-time LoRA adapter updates are off on this server "
                                  "(lora.allow_runtime_updates).", "permission_error", None, "runtime_updates_off")

    async def load(self, req: LoadLoRAAdapterRequest, check: Check) -> str:
        self._check_updates_allowed()
        name = req.lora_name
        if self.registry is not None:
            await self._sync()
        if name == self.base_model:
            raise errors.bad_request("lora_name must be a new name, not the base model's.", "lora_name")
        if name in self.adapters:
            raise errors.bad_request(f"The LoRA adapter '{name}' has already been loaded.", "lora_name")
        running = self._loads.get(name)
        if running is not None:  # one check per name: the others wait for it and see its result
            return await asyncio.shield(running)
        if len(self.adapters) + len(self._loads) >= self.policy.max_adapters:
            raise errors.bad_request(f"This server serves at most {self.policy.max_adapters} LoRA adapters "
                                     f"(lora.max_adapters); unload one first.", "lora_name")
        if len(self._loads) >= self.policy.max_concurrent_loads:
            raise errors.APIError(429, "Too many LoRA adapter loads in progress; retry later.",
                                  "rate_limit_error", None, "too_many_loads")
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._loads[name] = future
        try:
            result = await self._load(name, req.lora_path, check)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # retrieved: waiters re-raise it, an unwaited one logs nothing
            raise
        else:
            future.set_result(result)
            return result
        finally:
            del self._loads[name]

    async def _load(self, name: str, path: str, check: Check) -> str:
        if not self.policy.adapter_roots:
            raise errors.bad_request("No adapter directory is allowed for run-time loads "
                                     "(lora.adapter_roots is empty).", "lora_path")
        if not os.path.isabs(path) or ".." in path.split("/"):
            raise errors.bad_request("lora_path must be an absolute path without '..'.", "lora_path")
        try:
            # a bad adapter: its worker's LoRAAdapterError, a 400
            resolved, digest = await asyncio.wait_for(check(name, path, self.policy.adapter_roots),
                                                      self.policy.load_timeout_s)
        except asyncio.TimeoutError:
            raise errors.APIError(504, "Checking the LoRA adapter took too long.", "server_error", None,
                                  "lora_load_timeout") from None
        adapter = Adapter(resolved, make_ref(resolved, digest) if digest else resolved)
        if self.registry is not None:
            await self._share(name, adapter)
        self.adapters[name] = adapter
        return f"Success: LoRA adapter '{name}' added successfully."

    async def _share(self, name: str, adapter: Adapter) -> None:
        assert self.registry is not None
        outcome = await self.registry.add(name, adapter.path, adapter.ref, self.policy.max_adapters)
        if outcome == "exists":  # another replica loaded the name meanwhile
            raise errors.bad_request(f"The LoRA adapter '{name}' has already been loaded.", "lora_name")
        if outcome == "full":
            raise errors.bad_request(f"This server serves at most {self.policy.max_adapters} LoRA adapters "
                                     f"(lora.max_adapters); unload one first.", "lora_name")

    async def unload(self, req: UnloadLoRAAdapterRequest) -> str:
        self._check_updates_allowed()
        name = req.lora_name
        if self.registry is not None:
            await self._sync()
        if name in self._configured and self.registry is not None:  # every replica's own: it would come back
            raise errors.bad_request(f"The LoRA adapter '{name}' is configured (lora.modules); remove it from "
                                     "the configuration instead.", "lora_name")
        if name not in self.adapters:
            raise not_found(name, sorted(self.adapters), what="LoRA adapter")
        if self.registry is not None and not await self.registry.remove(name):
            raise not_found(name, sorted(self.adapters), what="LoRA adapter")  # another replica unloaded it
        del self.adapters[name]
        return f"Success: LoRA adapter '{name}' removed successfully."


def not_found(name: str, known: list[str], what: str = "model") -> errors.APIError:
    listed = ", ".join(f"`{k}`" for k in known) or "none"
    shown = name if len(name) <= MAX_LORA_NAME_CHARS else name[:MAX_LORA_NAME_CHARS] + "..."
    return errors.APIError(404, f"The {what} `{shown}` does not exist. Known: {listed}.", "invalid_request_error",
                           "model" if what == "model" else "lora_name", "model_not_found")
