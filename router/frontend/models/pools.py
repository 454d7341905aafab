"""What cluster/ hands the ingress for one served model: its settings and its pools.

At bind time the handles are Serve Applications (bound worker deployments); Serve replaces
them, wherever they sit in the ingress's arguments, with DeploymentHandles.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.frontend.settings import MAX_WAITING_FOR_DECODE, IngressSettings


@dataclass(frozen=True)
class ModelPools:
    settings: IngressSettings  # served_model_name names the model
    worker: Any  # the worker pool's handle (the decode pool's when disaggregated)
    prefill_worker: Any = None  # the prefill pool's handle, when disaggregated
    max_waiting_for_decode: int = MAX_WAITING_FOR_DECODE
