"""worker.api.load_tokenizer's direct path: a tokenizer.json whose config names the generic
class loads as AutoTokenizer would load it, without importing torch (a simulated-device
replica or an ingress has no other use for torch; AutoTokenizer's import costs ~4 s of
CPU per process)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from worker.api import _tokenizer_class, load_tokenizer
from worker.default_model import default_model_path

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo, wörld 123"}]


def test_the_direct_path_loads_what_autotokenizer_loads() -> None:
    path = Path(default_model_path())
    assert _tokenizer_class(path) == "TokenizersBackend"
    direct, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(direct) is type(auto)
    text = "The quick brown fox, naïvely: 3.14 <|user|>"
    assert direct.encode(text) == auto.encode(text)
    assert direct.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert (direct.eos_token_id, direct.bos_token_id, direct.pad_token_id) == \
        (auto.eos_token_id, auto.bos_token_id, auto.pad_token_id)
    assert direct.all_special_ids == auto.all_special_ids


def test_a_simulated_device_engine_never_imports_torch() -> None:
    """The engine and its tokenizer on sim:h200, as every replica of a simulated fleet
    builds them (16 replicas starting at once spent ~60 s of CPU importing torch)."""
    code = ("import sys; from worker.config import EngineConfig, ModelConfig, SchedulerConfig; "
            "from worker.engine.async_engine import AsyncEngine; from worker.default_model import default_model_path; "
            "AsyncEngine.from_config(EngineConfig(model=ModelConfig(model=default_model_path(), device='sim:h200', "
            "model_shape='llama-3-8b'), scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, "
            "max_model_len=1024))); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[4])
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_other_classes_and_directories_go_through_autotokenizer(tmp_path: Path) -> None:
    assert _tokenizer_class(tmp_path) is None  # no tokenizer files at all
    src = Path(default_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    assert _tokenizer_class(tmp_path) == "LlamaTokenizer"  # not generic: AutoTokenizer resolves it
    (tmp_path / "tokenizer.json").unlink()
    assert _tokenizer_class(tmp_path) is None  # a slow tokenizer's files (no tokenizer.json)
