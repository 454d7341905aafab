"""The async engine's inbox: what callers on the event loop ask of the step thread, one
message each, put on a thread-safe queue and applied by the step loop between steps
(worker/engine/async_engine.py). Only the step thread touches the engine core, so every change
a caller makes to it travels as one of these.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from worker.api import SamplingParams


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    export_kv: bool = False  # disaggregation, prefill side (Engine.add_request)
    kv_import: Any = None  # disaggregation, decode side: a kv.transfer.KVExport
    lora: tuple[str, str | None] | None = None  # (adapter name, its PEFT directory)
    quiet: bool = False  # outputs at the first token and the end only (Engine.add_request)
    num_resumed_tokens: int = 0  # a migrated request's earlier output (Engine.add_request)
    session_id: str | None = None  # the client's session (Engine.add_request)


@dataclass
class ReleaseKV:
    request_id: str


@dataclass
class ResetPrefixCache:
    done: asyncio.Future[None]


@dataclass
class UnloadLoRA:
    name: str
    done: asyncio.Future[bool]


@dataclass
class AbortRequest:
    request_id: str
    notify: bool  # send the caller a final "abort" output (False when the caller left)


# Ends the step loop (AsyncEngine.shutdown).
STOP = object()
