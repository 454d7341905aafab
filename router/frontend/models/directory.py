"""The models an ingress replica serves, and which one a request is for.

A request's `model` names a served model or one of its LoRA adapters (an adapter resolves
to its base model's pools); no `model` (where an endpoint allows it) is the first model
the caller may use.
A key limited to some models (settings.key_models) is told that any other model does not
exist: the same 404 model_not_found as an unknown name, listing only what the key may use,
so that a key cannot learn which other models run here (docs/security.md).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from router import errors
from router.frontend.auth import Principal
from router.frontend.lora_modules import not_found
from router.frontend.models.serving import ModelServing


class ModelDirectory:
    def __init__(self, servings: Sequence[ModelServing], key_models: Mapping[str, Sequence[str]]) -> None:
        if not servings:
            raise ValueError("an ingress serves at least one model")
        self.servings = {s.name: s for s in servings}
        self.default = servings[0]  # the first model: the ingress-wide settings are its
        self._key_models = {key_id: frozenset(names) for key_id, names in key_models.items()}

    def allowed(self, principal: Principal) -> list[ModelServing]:
        """The models `principal` may use, in the config's order."""
        names = self._key_models.get(principal.key_id)
        return [s for s in self.servings.values() if names is None or s.name in names]

    async def find(self, model: str | None, principal: Principal) -> ModelServing:
        """The served model a request's `model` is for (404 model_not_found when it names
        none the caller may use)."""
        if not model:  # the first model the caller may use
            allowed = self.allowed(principal)
            if not allowed:
                raise self.not_found("", principal)
            return allowed[0]
        serving = self._lookup(model)
        if serving is None:  # perhaps an adapter another replica loaded at run time
            for candidate in self.servings.values():
                await candidate.pipeline.lora.refresh(model)
            serving = self._lookup(model)
        if serving is None or serving not in self.allowed(principal):
            raise self.not_found(model or "", principal)
        return serving

    def _lookup(self, model: str) -> ModelServing | None:
        serving = self.servings.get(model)
        if serving is not None:
            return serving
        return next((s for s in self.servings.values() if model in s.pipeline.lora.adapters), None)

    def owner_of(self, adapter: str) -> ModelServing:
        """The model serving LoRA adapter `adapter` (the first model when none does: its
        unload then answers that the adapter is unknown)."""
        return next((s for s in self.servings.values() if adapter in s.pipeline.lora.adapters), self.default)

    def not_found(self, model: str, principal: Principal) -> errors.APIError:
        known = [name for s in self.allowed(principal) for name in (s.name, *sorted(s.pipeline.lora.adapters))]
        return not_found(model, known)

    async def unhealthy_reason(self) -> str | None:
        """None when every model's pools answer (router/frontend/health_verdict.py, cached);
        else the first model's reason that does not, named."""
        for serving in self.servings.values():
            reason = await serving.pipeline.workers.health.reason()
            if reason is not None:
                return f"model {serving.name}: {reason}" if len(self.servings) > 1 else reason
        return None

    def drain(self) -> int:
        """Every model's pipeline refuses new requests (503) from now on; returns how many
        (weighted by n) are still in flight."""
        for serving in self.servings.values():
            serving.pipeline.limiter.draining = True
        return self.in_flight()

    def in_flight(self) -> int:
        return sum(s.pipeline.limiter.in_flight for s in self.servings.values())
