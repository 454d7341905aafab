"""`kvserve serve` on a quantized checkpoint directory (GPTQ with desc_act, made in the test
in its real layout: tests/support/quant_checkpoints.py), as a user runs it: the OpenAI
completions endpoint answers with transformers' greedy tokens on the dequantized weights.

Does not use the session cluster: serve runs as its own process.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.serve_process import served_completion

pytestmark = pytest.mark.integration


def test_serve_a_gptq_directory(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from tests.support.quant_checkpoints import make_quantized
    from tests.support.tiny_models import hf_greedy
    from tests.support.tiny_served_model import make_served_model

    qdir, rdir = make_quantized(make_served_model(tmp_path / "src"), tmp_path / "gptq", "gptq_desc_act")
    prompt = "The quick brown fox"
    tokenizer = AutoTokenizer.from_pretrained(qdir)
    ids = tokenizer(prompt)["input_ids"]
    (expected,) = hf_greedy(rdir, [ids], [8])
    r = served_completion(tmp_path, qdir, prompt, 8, "kvgptq-")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == len(expected)
    assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
