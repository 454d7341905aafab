"""`kvserve serve` on a tiny Qwen3-MoE directory, as a new user would run it: a process of
its own, the model named by path in its config; the OpenAI completions endpoint answers
with transformers' greedy tokens for the same prompt.

Does not use the session cluster: serve runs as its own process.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.serve_process import served_completion

pytestmark = pytest.mark.integration


def test_serve_a_qwen3_moe_directory(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from tests.support.tiny_models import hf_greedy
    from tests.support.tiny_moe import make_tiny_moe
    from tests.support.tiny_served_model import make_served_model

    model_dir = make_served_model(tmp_path / "qwen3-moe",
                                  weights=lambda out, vocab: make_tiny_moe("qwen3_moe", out, vocab_size=vocab))
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    prompt = "The quick brown fox"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    (expected,) = hf_greedy(model_dir, [tokenizer(prompt)["input_ids"]], [8])
    r = served_completion(tmp_path, model_dir, prompt, 8, "kvmoe-")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == len(expected)
    assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
