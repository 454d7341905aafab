"""Fixtures of the model-family tests: tiny MoE checkpoints (tests/support/tiny_moe.py) and
Gemma 3 checkpoints (tests/support/tiny_gemma.py), built once per session, and
transformers' greedy outputs on them, memoised."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.conftest import HFReference


class TinyMoEModels:
    """`tiny_moe(family) -> Path`, built on first use. `reference_dir(family)` is the
    checkpoint transformers runs for it (a rewritten checkpoint's original)."""

    # Checkpoints that hold another family's weights in another layout.
    SAME_WEIGHTS = {"qwen3_moe_fused": "qwen3_moe"}

    def __init__(self, root: Path) -> None:
        self.root = root
        self._dirs: dict[str, Path] = {}
        self._lock = threading.Lock()

    def __call__(self, family: str) -> Path:
        from tests.support.tiny_moe import make_tiny_moe

        with self._lock:
            if family not in self._dirs:
                self._dirs[family] = make_tiny_moe(family, self.root / family)
            return self._dirs[family]


class _ReferenceDirs:
    def __init__(self, models: TinyMoEModels) -> None:
        self.models = models

    def __call__(self, family: str) -> Path:
        return self.models(TinyMoEModels.SAME_WEIGHTS.get(family, family))


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> TinyMoEModels:
    return TinyMoEModels(tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="session")
def moe_reference(tiny_moe: TinyMoEModels) -> HFReference:
    """`moe_reference(family, prompts, max_tokens) -> list[list[int]]` (cached per session)."""
    return HFReference(_ReferenceDirs(tiny_moe))  # type: ignore[arg-type]


class TinyGemma:
    """`tiny_gemma(variant) -> Path`, built on first use (tests/support/tiny_gemma.py)."""

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


GemmaReference = HFReference


@pytest.fixture(scope="session")
def tiny_gemma(tmp_path_factory: pytest.TempPathFactory) -> TinyGemma:
    return TinyGemma(tmp_path_factory.mktemp("tiny-gemma"))


@pytest.fixture(scope="session")
def gemma_reference(tiny_gemma: TinyGemma) -> HFReference:
    """`gemma_reference(variant, prompts, max_tokens) -> list[list[int]]` (cached per session)."""
    return HFReference(tiny_gemma)  # type: ignore[arg-type]
