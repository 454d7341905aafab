"""Where a model's files are: a local directory or .gguf file, or a Hugging Face Hub id.
The one rule for telling them apart (the CLI's early check, the served model's name and
the workers' load all read a `--model` value through it). Torch-free, so that a
simulated-device replica (which loads no weights) never imports torch."""
from __future__ import annotations

from pathlib import Path

from worker.api import is_gguf


def local_model_path(model: str) -> Path | None:
    """`model` as a local model (a directory, or a .gguf file) when it is one, else None."""
    path = Path(model).expanduser()
    return path if path.is_dir() or (path.is_file() and is_gguf(path)) else None


def is_hub_id(model: str) -> bool:
    """Whether `model` names a Hub model: nothing by that name exists here, and it is not
    spelled as a path (a ./, / or ~ prefix, or a .gguf name). A local path that is missing
    is an error, never a download."""
    path = Path(model).expanduser()
    return not (path.exists() or is_gguf(path) or model.startswith((".", "/", "~")))


def resolve_model_path(model: str) -> Path:
    """A local directory or .gguf file as is; otherwise a Hub id, fetched when the machine
    is online."""
    local = local_model_path(model)
    if local is not None:
        return local
    if not is_hub_id(model):
        path = Path(model).expanduser()
        if path.exists():
            raise FileNotFoundError(f"model {model!r} is a file, not a model directory or a .gguf file")
        raise FileNotFoundError(f"GGUF file {model!r} not found" if is_gguf(path) else f"model directory {model!r} not found")
    try:
        # huggingface_hub: only a hub id needs it; the ingress imports this module
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"])
        )
    except Exception as e:
        raise FileNotFoundError(
            f"model {model!r} is neither a local directory nor a reachable Hugging Face Hub id ({e})"
        ) from e
