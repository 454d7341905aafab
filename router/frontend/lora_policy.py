"""What the ingress allows of run-time LoRA adapter updates (POST /v1/load_lora_adapter,
/v1/unload_lora_adapter): off unless configured, confined to configured directories, and
bounded. Built by cluster/lora_config.py from the `lora` section.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_LORA_NAME_CHARS = 128


@dataclass(frozen=True)
class LoRAPolicy:
    # Run-time loads and unloads (admin keys only, router/frontend/auth.py); False: every
    # call is refused (403), whether or not LoRA serving is on.
    runtime_updates: bool = False
    # A run-time adapter's directory must resolve (realpath: `..` and symlinks followed)
    # inside one of these; none configured: every run-time load is refused.
    adapter_roots: tuple[str, ...] = ()
    # Adapters known at once (configured ones included); one more load: 400.
    max_adapters: int = 64
    # Loads checked at once by this ingress replica; one more: 429.
    max_concurrent_loads: int = 2
    # A load's check on a worker replica must finish within this long (504 otherwise).
    load_timeout_s: float = 60.0
