"""Where a model's files are: a local directory or .gguf file, or a Hugging Face Hub id.
Torch-free, so that a simulated-device replica (which loads no weights) never imports torch
(worker/model/loader.py, which does, re-exports it)."""
from __future__ import annotations

from pathlib import Path

from worker.api import is_gguf


def resolve_model_path(model: str) -> Path:
    """A local directory or .gguf file as is; otherwise a Hub id, fetched when the machine
    is online."""
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and is_gguf(path)):
        return path
    if is_gguf(path):
        raise FileNotFoundError(f"GGUF file {model!r} not found")
    if path.exists() or model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model directory {model!r} not found")
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"])
        )
    except Exception as e:
        raise FileNotFoundError(
            f"model {model!r} is neither a local directory nor a reachable Hugging Face Hub id ({e})"
        ) from e
