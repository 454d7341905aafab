"""Fixtures for the model-family tests: tiny Gemma 3 checkpoints and transformers' greedy
outputs on them, each built once per session."""
from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest


class TinyGemma:
    """Builds each Gemma 3 variant's checkpoint on first use (tests/support/tiny_gemma.py)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._dirs: dict[str, Path] = {}
        self._lock = threading.Lock()

    def __call__(self, variant: str) -> Path:
        from tests.support.tiny_gemma import make_tiny_gemma3

        with self._lock:
            if variant not in self._dirs:
                self._dirs[variant] = make_tiny_gemma3(variant, self.root / variant)
            return self._dirs[variant]


class GemmaReference:
    """transformers' greedy `generate` on a variant, memoised per (variant, prompt, max_tokens)."""

    def __init__(self, models: TinyGemma) -> None:
        self.models = models
        self._cache: dict[tuple[str, tuple[int, ...], int], list[int]] = {}

    def __call__(self, variant: str, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> list[list[int]]:
        from tests.support.tiny_models import hf_greedy

        keys = [(variant, tuple(p), n) for p, n in zip(prompts, max_tokens, strict=True)]
        missing = list(dict.fromkeys(k for k in keys if k not in self._cache))
        if missing:
            outs = hf_greedy(self.models(variant), [list(k[1]) for k in missing], [k[2] for k in missing])
            self._cache.update(zip(missing, outs))
        return [list(self._cache[k]) for k in keys]


@pytest.fixture(scope="session")
def tiny_gemma(tmp_path_factory: pytest.TempPathFactory) -> TinyGemma:
    return TinyGemma(tmp_path_factory.mktemp("tiny-gemma"))


@pytest.fixture(scope="session")
def gemma_reference(tiny_gemma: TinyGemma) -> GemmaReference:
    return GemmaReference(tiny_gemma)
