"""What the engine hands back, per request, per step. The types live in worker/api.py
(torch-free, what other layers import); worker/ internals may import them from here."""
from __future__ import annotations

from worker.api import RequestOutput, TokenLogprob

__all__ = ["RequestOutput", "TokenLogprob"]
