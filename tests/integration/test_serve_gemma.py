"""`kvserve serve` on a tiny Gemma 3 text directory, as a new user would run it: a process
of its own, the model named by path in its config; the OpenAI completions endpoint answers
with transformers' greedy tokens for a prompt longer than the local layers' window.

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


def _served_gemma(out: Path) -> Path:
    """make_served_model's tokenizer and chat template with a tiny Gemma 3 of its vocab."""
    from tests.support.tiny_gemma import make_tiny_gemma3
    from tests.support.tiny_served_model import make_served_model

    make_served_model(out)
    vocab_size = json.loads((out / "config.json").read_text())["vocab_size"]
    (out / "model.safetensors").unlink()
    (out / "generation_config.json").unlink(missing_ok=True)
    return make_tiny_gemma3("gemma3", out, vocab_size=vocab_size)


def test_serve_a_gemma3_directory(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from tests.support.tiny_gemma import GEMMA_WINDOW
    from tests.support.tiny_models import hf_greedy

    model_dir = _served_gemma(tmp_path / "gemma3")
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    prompt = "A serving cluster routes each request to the replica with the most free cache. " * 2
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(prompt)["input_ids"]
    assert len(ids) > GEMMA_WINDOW
    (expected,) = hf_greedy(model_dir, [ids], [12])
    port, grpc_port = free_port(), free_port()
    config = (
        f"model: {model_dir}\n"
        "engine: {device: cpu, dtype: float32, num_threads: 1, num_blocks: 64}\n"
        "workers: {num_replicas: 1, num_cpus: 1, drain_timeout_s: 5}\n"
        "ingress: {num_cpus: 0.5}\n"
    )
    with kvserve_serve(tmp_path, config, port, grpc_port, short_ray_tmp("kvgemma-")):
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()
        name = models["data"][0]["id"]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
            "model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0.0,
        })
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == len(expected)
        assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
