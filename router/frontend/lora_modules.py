"""The LoRA adapters this ingress serves, by the name clients send as `model`, and vLLM's
load/unload endpoints' logic (POST /v1/load_lora_adapter, /v1/unload_lora_adapter).

Every engine request names its adapter *with its path* (GenerateRequest.lora_path), so any
worker replica serves any adapter the ingress knows, a replica started after the adapter
was loaded included: it reads the adapter on its first request (worker/lora/). A load is
checked by one worker replica first (the whole adapter read against the model), so a bad
adapter is a 400 at load and never reaches a request.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from pydantic import BaseModel, ConfigDict

from router import errors


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str | None = None  # accepted as vLLM does; the name decides


class LoRAModules:
    def __init__(self, base_model: str, modules: tuple[tuple[str, str], ...], enabled: bool) -> None:
        self.base_model = base_model
        self.paths: dict[str, str] = dict(modules)
        self.enabled = enabled or bool(modules)

    def resolve(self, model: str | None) -> tuple[str, str] | None:
        """The adapter (name, path) a request's `model` picks; None: the base model. An
        unknown name is a 404 that lists the known ones."""
        if not model or model == self.base_model:
            return None
        path = self.paths.get(model)
        if path is None:
            raise not_found(model, [self.base_model, *sorted(self.paths)])
        return model, path

    async def load(self, req: LoadLoRAAdapterRequest, check: Callable[[str, str], Awaitable[None]]) -> str:
        if not self.enabled:
            raise errors.bad_request("This server does not serve LoRA adapters; start it with lora.enable "
                                     "(--enable-lora) or lora.modules (--lora-modules).", "lora_name")
        name = req.lora_name
        if not name or name == self.base_model:
            raise errors.bad_request(f"lora_name must be a new name, not {name!r}.", "lora_name")
        if name in self.paths:
            raise errors.bad_request(f"The LoRA adapter '{name}' has already been loaded.", "lora_name")
        await check(name, req.lora_path)  # a bad adapter: its worker's LoRAAdapterError, a 400
        self.paths[name] = req.lora_path
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, req: UnloadLoRAAdapterRequest) -> str:
        if req.lora_name not in self.paths:
            raise not_found(req.lora_name, sorted(self.paths), what="LoRA adapter")
        del self.paths[req.lora_name]
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."


def not_found(name: str, known: list[str], what: str = "model") -> errors.APIError:
    listed = ", ".join(f"`{k}`" for k in known) or "none"
    return errors.APIError(404, f"The {what} `{name}` does not exist. Known: {listed}.", "invalid_request_error",
                           "model" if what == "model" else "lora_name", "model_not_found")
