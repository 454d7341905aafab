"""Fixtures the worker tests on the real SmolLM2 GGUF model share (found once per session)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.real_models import require_smollm2_gguf
from worker.api import load_tokenizer


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return require_smollm2_gguf()


@pytest.fixture(scope="session")
def tokenizer(gguf_path: Path) -> Any:
    return load_tokenizer(gguf_path)
