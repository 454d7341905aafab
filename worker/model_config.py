"""Reading a Hugging Face model directory's config: architecture and stop tokens."""
from __future__ import annotations

import json
from pathlib import Path


def load_hf_config(path: Path) -> object:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def eos_token_ids_of(path: Path, hf_config: object) -> frozenset[int]:
    """EOS ids from config.json and generation_config.json (Llama 3 lists several)."""
    ids: set[int] = set()

    def add(value: object) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(hf_config, "eos_token_id", None))
    gen = Path(path) / "generation_config.json"
    if gen.exists():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    return frozenset(ids)
