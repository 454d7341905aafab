"""Reasoning output end to end: the embedded kvserve-tiny model served with a chat
template whose generation prompt opens a `<think>` block (as DeepSeek-R1's does), the
reasoning parser on `auto`. The random model never closes the block, so its whole output
is thinking: reasoning_content in chat (whole and streamed), a reasoning item in
Responses, a thinking block in Messages; each the same text /v1/completions gives for the
rendered prompt (greedy)."""
from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

pytestmark = pytest.mark.integration

MODEL = "tiny-think"
APP = "reasoning-test"
QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def base_url(serve_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from ray import serve

    from cluster.config import KVServeConfig
    from tests.integration.tiny_app import deploy
    from worker.default_model import default_model_path

    model_dir = tmp_path_factory.mktemp("think") / "model"
    shutil.copytree(default_model_path(), model_dir)
    template = model_dir / "chat_template.jinja"
    text = template.read_text()
    assert "'<|assistant|>\\n'" in text
    template.write_text(text.replace("'<|assistant|>\\n'", "'<|assistant|>\\n<think>\\n'"))
    config = KVServeConfig.from_dict({
        "app_name": APP, "route_prefix": f"/{APP}",
        "model": {"path": str(model_dir), "served_model_name": MODEL},
        "engine": {"block_size": 16, "num_blocks": 128, "max_model_len": 1024, "max_num_seqs": 8,
                   "device": "cpu", "dtype": "float32", "num_threads": 1},
        "workers": {"num_replicas": 1, "num_cpus": 1, "stream_interval_ms": 0},
        "ingress": {"num_cpus": 0.5, "request_timeout_s": 300, "api_keys_env": None},
    })
    deploy(config)
    try:
        yield f"{serve_cluster.http_url}/{APP}/v1"
    finally:
        serve.delete(APP)


def raw_text(client: openai.OpenAI, base_url: str) -> str:
    """The model's own output for the rendered prompt, no parser in the way."""
    import httpx

    ids = httpx.post(base_url.removesuffix("/v1") + "/tokenize", json={"model": MODEL, "messages": QUESTION}, timeout=60).json()["tokens"]
    return client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=12).choices[0].text


def test_thinking_comes_apart_in_every_api(base_url: str) -> None:
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as client:
        raw = raw_text(client, base_url)
        assert raw
        whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=12)
        message = whole.choices[0].message
        assert message.reasoning_content == raw and not message.content  # type: ignore[attr-defined]
        chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=12, stream=True))
        streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
        assert streamed == raw and not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        response = client.responses.create(model=MODEL, input=QUESTION[0]["content"], temperature=0, max_output_tokens=12)
        reasoning = [item for item in response.output if item.type == "reasoning"]
        assert reasoning and reasoning[0].content is not None and reasoning[0].content[0].text == raw
        assert response.usage is not None and 0 < response.usage.output_tokens_details.reasoning_tokens <= response.usage.output_tokens + 2
    with anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=300) as claude:
        out = claude.messages.create(model=MODEL, messages=QUESTION, max_tokens=12, extra_body={"temperature": 0})  # type: ignore[arg-type]
        assert out.content[0].type == "thinking" and out.content[0].thinking == raw
        with claude.messages.stream(model=MODEL, messages=QUESTION, max_tokens=12, extra_body={"temperature": 0}) as stream:  # type: ignore[arg-type]
            final = stream.get_final_message()
        assert final.content[0].type == "thinking" and final.content[0].thinking == raw
