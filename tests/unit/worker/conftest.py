"""Fixtures the worker tests share: the real SmolLM2 GGUF model (found once per session), the
simulated device's fake clock, and async engines shut down after a test."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.real_models import require_smollm2_gguf
from tests.support.sim_overlap import FakeClock
from worker.api import load_tokenizer
from worker.engine.async_engine import AsyncEngine
from worker.sim import runner as sim_runner


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return require_smollm2_gguf()


@pytest.fixture(scope="session")
def tokenizer(gguf_path: Path) -> Any:
    return load_tokenizer(gguf_path)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The simulated runner's clock, faked (tests/support/sim_overlap.py)."""
    fake = FakeClock()
    monkeypatch.setattr(sim_runner, "time", fake)
    return fake


@pytest.fixture
def engines() -> Iterator[list[AsyncEngine]]:
    """AsyncEngines a test starts, shut down after it."""
    started: list[AsyncEngine] = []
    yield started
    for ae in started:
        ae.shutdown()
