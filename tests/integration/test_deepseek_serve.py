"""DeepSeek-V3 (MLA, grouped MoE) through the whole served stack on CPU: the OpenAI
completions of a one-device app are transformers' greedy text; a tensor-parallel (2 ranks,
latent pool replicated) app and a disaggregated app (latent blocks exported by the
prefill pool, imported by the decode pool) answer the same, streams included."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.tiny_app import stream_text, tiny_config

pytestmark = pytest.mark.integration

ONE, TP2, PD, MODEL = "ds-one", "ds-tp2", "ds-pd", "tiny-deepseek"
PROMPTS = [
    "Hello world! The quick brown fox",
    "Paged attention stores keys and values in fixed-size blocks. A serving cluster routes",
    "What is the capital of France?",
]
MAX_TOKENS = 12
POOL = {"num_replicas": 1, "num_cpus": 0.5}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.tiny_deepseek import make_served_deepseek

    return make_served_deepseek(tmp_path_factory.mktemp("served-deepseek") / "tiny")


@pytest.fixture(scope="module")
def apps(serve_cluster: Any, model_dir: Path) -> Iterator[str]:
    from ray import serve

    from cluster.app import build_app

    one = tiny_config(ONE, model_dir, MODEL)
    two = tiny_config(TP2, model_dir, MODEL).with_overrides({"workers": {**POOL, "tensor_parallel_size": 2}})
    pd = tiny_config(PD, model_dir, MODEL).with_overrides(
        {"disaggregation": {"prefill": POOL, "decode": POOL, "max_waiting_for_decode": 64}}
    )
    for config in (one, two, pd):
        serve.run(build_app(config), name=config.app_name, route_prefix=config.route_prefix)
    try:
        yield serve_cluster.http_url
    finally:
        for name in (PD, TP2, ONE):
            serve.delete(name)


def _hf_texts(model_dir: Path) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=0)
        new = [t for t in out[0, ids.shape[1]:].tolist() if t != tok.eos_token_id]
        texts.append(tok.decode(new))
    return texts


def _text(base: str, app: str, prompt: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(f"{base}/{app}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_completions_are_transformers_greedy(apps: str, model_dir: Path) -> None:
    for prompt, expected in zip(PROMPTS, _hf_texts(model_dir)):
        assert _text(apps, ONE, prompt) == expected, prompt


def test_tensor_parallel_and_disaggregated_apps_answer_the_same(apps: str) -> None:
    for prompt in PROMPTS:
        expected = _text(apps, ONE, prompt)
        assert _text(apps, TP2, prompt) == expected, prompt
        assert _text(apps, PD, prompt) == expected, prompt
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        assert stream_text(f"{apps}/{TP2}/v1/completions", body)[0] == expected, prompt
