"""`kvserve serve` on a tiny Qwen3-MoE directory, as a new user would run it: a process of
its own, the model named by path in its config; the OpenAI completions endpoint answers
with transformers' greedy tokens for the same prompt.

Does not use the session cluster: serve runs as its own process.
"""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import free_port
from tests.support.serve_process import kvserve_serve, short_ray_tmp

pytestmark = pytest.mark.integration


def _served_moe(out: Path) -> Path:
    """make_served_model's tokenizer and chat template with a tiny Qwen3-MoE of its vocab."""
    from tests.support.tiny_moe import make_tiny_moe
    from tests.support.tiny_served_model import make_served_model

    make_served_model(out)
    vocab_size = json.loads((out / "config.json").read_text())["vocab_size"]
    (out / "model.safetensors").unlink()
    return make_tiny_moe("qwen3_moe", out, vocab_size=vocab_size)


def test_serve_a_qwen3_moe_directory(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from tests.support.tiny_models import hf_greedy

    model_dir = _served_moe(tmp_path / "qwen3-moe")
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    prompt = "The quick brown fox"
    ids = AutoTokenizer.from_pretrained(model_dir)(prompt)["input_ids"]
    (expected,) = hf_greedy(model_dir, [ids], [8])
    port, grpc_port = free_port(), free_port()
    config = (
        f"model: {model_dir}\n"
        "engine: {device: cpu, dtype: float32, num_threads: 1, num_blocks: 64}\n"
        "workers: {num_replicas: 1, num_cpus: 1, drain_timeout_s: 5}\n"
        "ingress: {num_cpus: 0.5}\n"
    )
    with kvserve_serve(tmp_path, config, port, grpc_port, short_ray_tmp("kvmoe-")):
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()
        name = models["data"][0]["id"]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
            "model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
        })
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == len(expected)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
