"""A tensor-parallel rank's adapter store (worker/tp/rank_lora.py): it keeps what rank 0's
loader had it read, drops the least recently loaded beyond its capacity, reads a dropped
adapter again from the path rank 0 sent when a slot write needs it, and reads an
adapter again when its name comes back with another path."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from worker.tp.rank_lora import RankLoRAStore

if TYPE_CHECKING:
    from tests.conftest import TinyModels


def test_store_keeps_drops_and_rereads(tiny_model: TinyModels, tmp_path: Path) -> None:
    from tests.support.tiny_lora import make_tiny_adapter
    from worker.lora.model_lora import adapter_loader
    from worker.model.llama import LlamaArch
    from worker.model_config import load_hf_config

    base = tiny_model("llama")
    paths = {n: make_tiny_adapter(base, tmp_path / n, r, ("q_proj",), seed=r) for n, r in (("a", 4), ("b", 8))}
    moved = make_tiny_adapter(base, tmp_path / "a2", 2, ("q_proj",), seed=9)
    real = adapter_loader(LlamaArch.from_hf_config(load_hf_config(base)), 16)
    reads: list[str] = []
    store = RankLoRAStore(lambda name, path: reads.append(path) or real(name, path), capacity=1)
    store.load("a", str(paths["a"]))
    assert store.get("a").rank == 4 and reads == [str(paths["a"])]
    store.load("b", str(paths["b"]))  # capacity 1: "a" is dropped
    assert store.get("b").rank == 8 and len(reads) == 2
    assert store.get("a").rank == 4 and len(reads) == 3  # read again on the step
    store.load("a", str(moved))  # the name now names another adapter
    assert store.get("a").rank == 2 and reads[-1] == str(moved)
    with pytest.raises(KeyError, match="never loaded"):
        store.get("c")
