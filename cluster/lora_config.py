"""The `lora` section of the config schema (multi-LoRA serving, worker/lora/).

    lora:
      modules: {sql: /adapters/sql-lora, chat: /adapters/chat-lora}   # name -> PEFT directory
      max_loras: 4          # adapters a step can mix (device slots per worker replica)
      max_lora_rank: 16     # every slot is this rank; larger adapters are refused at load
      max_cpu_loras: 16     # adapters kept in each replica's host memory (LRU)

Adapters are served under their name (the request's `model`). Run-time loads and unloads
(POST /v1/load_lora_adapter, /v1/unload_lora_adapter) are off unless configured, and then
take an admin key (docs/security.md):

      allow_runtime_updates: true
      adapter_roots: [/adapters]   # a loaded directory must resolve inside one of these
      max_adapters: 64             # adapters known at once (configured ones included)
      max_concurrent_loads: 2      # per ingress replica; one more: 429
      load_timeout_s: 60
      max_adapter_bytes: 2Gi       # each adapter file, checked before it is read
"""
from __future__ import annotations

from pydantic import Field, model_validator

from cluster.config_fields import ByteSize, Section, build, default_of
from router.frontend.lora_policy import LoRAPolicy
from worker.config import MAX_SUPPORTED_LORA_RANK, LoRAConfig


class LoRASection(Section):
    enable: bool = default_of(LoRAConfig, "enable")
    modules: dict[str, str] = Field(default_factory=dict)
    max_loras: int = Field(default_of(LoRAConfig, "max_loras"), ge=1)
    max_lora_rank: int = Field(default_of(LoRAConfig, "max_lora_rank"), ge=1, le=MAX_SUPPORTED_LORA_RANK)
    max_cpu_loras: int | None = Field(default_of(LoRAConfig, "max_cpu_loras"), ge=1)
    # Each adapter file (config, weights) is at most this large; checked before it is read.
    max_adapter_bytes: ByteSize = Field(default_of(LoRAConfig, "max_adapter_bytes"), gt=0)
    # Run-time adapter loads/unloads (admin keys only). Off by default, LoRA on or not.
    allow_runtime_updates: bool = default_of(LoRAPolicy, "runtime_updates")
    # Absolute directories a run-time adapter must resolve inside (symlinks and `..` followed).
    adapter_roots: list[str] = Field(default_factory=list)
    max_adapters: int = Field(default_of(LoRAPolicy, "max_adapters"), ge=1, le=4096)
    max_concurrent_loads: int = Field(default_of(LoRAPolicy, "max_concurrent_loads"), ge=1, le=64)
    load_timeout_s: float = Field(default_of(LoRAPolicy, "load_timeout_s"), gt=0, le=3600)

    @model_validator(mode="after")
    def _runtime_updates(self) -> LoRASection:
        if any(not root.startswith("/") for root in self.adapter_roots):
            raise ValueError("lora.adapter_roots must be absolute directories")
        if self.allow_runtime_updates and not self.adapter_roots:
            raise ValueError("lora.allow_runtime_updates needs lora.adapter_roots (the directories adapters "
                             "may be loaded from)")
        if len(self.modules) > self.max_adapters:
            raise ValueError(f"lora.modules has {len(self.modules)} adapters; lora.max_adapters is {self.max_adapters}")
        return self

    def lora_config(self) -> LoRAConfig:
        return build(LoRAConfig, self, modules=tuple(sorted(self.modules.items())))

    def policy(self) -> LoRAPolicy:
        """What the ingress allows of run-time updates (router/frontend/lora_policy.py)."""
        return LoRAPolicy(runtime_updates=self.allow_runtime_updates, adapter_roots=tuple(self.adapter_roots),
                          max_adapters=self.max_adapters, max_concurrent_loads=self.max_concurrent_loads,
                          load_timeout_s=self.load_timeout_s)

    @property
    def module_items(self) -> tuple[tuple[str, str], ...]:
        return tuple(sorted(self.modules.items()))


def parse_lora_modules(values: list[str]) -> dict[str, str]:
    """vLLM's `--lora-modules name=path ...` (a JSON object per item is vLLM's other form,
    {"name": ..., "path": ...})."""
    import json

    modules: dict[str, str] = {}
    for value in values:
        if value.lstrip().startswith("{"):
            item = json.loads(value)
            name, path = item.get("name"), item.get("path")
        else:
            name, sep, path = value.partition("=")
            if not sep:
                name = None
        if not name or not path:
            raise ValueError(f"--lora-modules takes name=path (or {{\"name\": ..., \"path\": ...}}), got {value!r}")
        modules[name] = path
    return modules
