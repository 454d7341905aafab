"""The `lora` section of the config schema (multi-LoRA serving, worker/lora/).

    lora:
      modules: {sql: /adapters/sql-lora, chat: /adapters/chat-lora}   # name -> PEFT directory
      max_loras: 4          # adapters a step can mix (device slots per worker replica)
      max_lora_rank: 16     # every slot is this rank; larger adapters are refused at load
      max_cpu_loras: 16     # adapters kept in each replica's host memory (LRU)

Adapters are served under their name (the request's `model`); more can be loaded at run
time through POST /v1/load_lora_adapter when `enable` is set (or modules are given).
"""
from __future__ import annotations

from pydantic import Field

from cluster.config_fields import Section, build, default_of
from worker.config import MAX_SUPPORTED_LORA_RANK, LoRAConfig


class LoRASection(Section):
    enable: bool = default_of(LoRAConfig, "enable")
    modules: dict[str, str] = Field(default_factory=dict)
    max_loras: int = Field(default_of(LoRAConfig, "max_loras"), ge=1)
    max_lora_rank: int = Field(default_of(LoRAConfig, "max_lora_rank"), ge=1, le=MAX_SUPPORTED_LORA_RANK)
    max_cpu_loras: int | None = Field(default_of(LoRAConfig, "max_cpu_loras"), ge=1)

    def lora_config(self) -> LoRAConfig:
        return build(LoRAConfig, self, modules=tuple(sorted(self.modules.items())))

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
