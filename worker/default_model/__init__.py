"""The embedded default model, `kvserve-tiny`.

A small Llama-family model and byte-level BPE tokenizer, built by this project's own
code (`python -m worker.default_model.build`) with no download and committed under
`files/`, so that the server runs offline on a fresh machine with no model argument.
It answers simple questions in short English sentences and stops with EOS; it exists to
exercise the engine, not to be smart.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_NAME = "kvserve-tiny"

_FILES_DIR = Path(__file__).resolve().parent / "files"
# The files a Hugging Face loader needs; checked so that a partial directory fails here
# with a useful message rather than deep inside transformers.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_model_path() -> str:
    """The directory of the default model, loadable with `from_pretrained`.

    Raises FileNotFoundError with the command that rebuilds the files when they are
    missing (for example in a source tree where they were deleted).
    """
    missing = [name for name in _REQUIRED_FILES if not (_FILES_DIR / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"The default model {DEFAULT_MODEL_NAME!r} is missing {', '.join(missing)} in "
            f"{_FILES_DIR}. Build it (offline, about two minutes on CPU) with: "
            f"python -m worker.default_model.build"
        )
    return str(_FILES_DIR)


__all__ = ["DEFAULT_MODEL_NAME", "default_model_path"]
