"""`kvserve serve` on a quantized checkpoint directory (GPTQ with desc_act, made in the test
in its real layout: tests/support/quant_checkpoints.py), as a user runs it: the OpenAI
completions endpoint answers with transformers' greedy tokens on the dequantized weights.

Does not use the session cluster: serve runs as its own process.
"""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import free_port
from tests.support.serve_process import kvserve_serve, short_ray_tmp

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
    port, grpc_port = free_port(), free_port()
    config = (
        f"model: {qdir}\n"
        "engine: {device: cpu, dtype: float32, num_threads: 1, num_blocks: 64}\n"
        "workers: {num_replicas: 1, num_cpus: 1, drain_timeout_s: 5}\n"
        "ingress: {num_cpus: 0.5}\n"
    )
    with kvserve_serve(tmp_path, config, port, grpc_port, short_ray_tmp("kvgptq-")):
        name = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"][0]["id"]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
            "model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
        })
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == len(expected)
        assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
