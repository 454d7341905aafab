"""Per-request sampling parameters. They live in worker/api.py (torch-free, what other
layers import); worker/ internals may import them from here."""
from __future__ import annotations

from worker.api import (
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    SamplingParamsError,
)

__all__ = [
    "MAX_LOGPROBS",
    "MAX_STOP_STRING_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_TOKEN_IDS",
    "SamplingParams",
    "SamplingParamsError",
]
