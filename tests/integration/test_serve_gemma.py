"""`kvserve serve` on a tiny Gemma 3 text directory, as a new user would run it: a process
of its own, the model named by path in its config; the OpenAI completions endpoint answers
with transformers' greedy tokens for a prompt longer than the local layers' window.

Does not use the session cluster: serve runs as its own process.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.serve_process import served_completion

pytestmark = pytest.mark.integration


def test_serve_a_gemma3_directory(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from tests.support.tiny_gemma import GEMMA_WINDOW, make_tiny_gemma3
    from tests.support.tiny_models import hf_greedy
    from tests.support.tiny_served_model import make_served_model

    model_dir = make_served_model(tmp_path / "gemma3",
                                  weights=lambda out, vocab: make_tiny_gemma3("gemma3", out, vocab_size=vocab))
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    prompt = "A serving cluster routes each request to the replica with the most free cache. " * 2
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(prompt)["input_ids"]
    assert len(ids) > GEMMA_WINDOW
    (expected,) = hf_greedy(model_dir, [ids], [12])
    r = served_completion(tmp_path, model_dir, prompt, 12, "kvgemma-")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == len(expected)
    assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
