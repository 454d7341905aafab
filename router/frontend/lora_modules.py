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
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from router import errors
from router.frontend.lora_policy import MAX_LORA_NAME_CHARS, LoRAPolicy
from worker.lora.identity import make_ref, read_adapter_files

# (name, directory, roots) -> (resolved directory, content digest): a worker replica's check.
Check = Callable[[str, str, tuple[str, ...]], Awaitable[tuple[str, str]]]
# A configured adapter's files are read at start-up (for its digest) up to this size each.
_STARTUP_DIGEST_MAX_BYTES = 2 * 1024**3


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=4096)


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
                 policy: LoRAPolicy | None = None) -> None:
        self.base_model = base_model
        self.policy = policy or LoRAPolicy()
        self.adapters: dict[str, Adapter] = {name: Adapter(path, startup_ref(path)) for name, path in modules}
        self.enabled = enabled or bool(modules)
        self._loads: dict[str, asyncio.Future[str]] = {}  # name -> the load under way

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
        self.adapters[name] = Adapter(resolved, make_ref(resolved, digest) if digest else resolved)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, req: UnloadLoRAAdapterRequest) -> str:
        self._check_updates_allowed()
        if req.lora_name not in self.adapters:
            raise not_found(req.lora_name, sorted(self.adapters), what="LoRA adapter")
        del self.adapters[req.lora_name]
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."


def not_found(name: str, known: list[str], what: str = "model") -> errors.APIError:
    listed = ", ".join(f"`{k}`" for k in known) or "none"
    shown = name if len(name) <= MAX_LORA_NAME_CHARS else name[:MAX_LORA_NAME_CHARS] + "..."
    return errors.APIError(404, f"The {what} `{shown}` does not exist. Known: {listed}.", "invalid_request_error",
                           "model" if what == "model" else "lora_name", "model_not_found")
