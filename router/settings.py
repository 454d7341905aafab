"""What the ingress needs to know, built by cluster/ from the user's config.

A frozen dataclass (not the pydantic schema) so that router/ does not depend on cluster/.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IngressSettings:
    served_model_name: str
    tokenizer_path: str  # a local directory or a Hub id (tokenizer files only are read)
    max_queued_requests: int = 1024  # weighted by n; beyond it: 429 at once
    max_body_bytes: int = 4 * 1024**2  # beyond it: 413
    max_n: int = 16
    request_timeout_s: float = 600.0
    trust_remote_code: bool = False
    # How long /metrics waits for the workers' stats before answering without them.
    stats_timeout_s: float = 2.0
