"""A thinking budget end to end through the official `anthropic` client: a tiny random
Llama served with a chat template whose generation prompt opens a `<think>` block (as
DeepSeek-R1's does). Alone, the model never closes the block; with
thinking.budget_tokens the engine closes it there (worker/sampling/thinking.py): the
thinking block is exactly the budget's worth of the model's greedy text
(/v1/completions on the rendered prompt) and an answer follows. Budgets Anthropic refuses
are 400s in its error shape."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

MODEL = "tiny-budget"
APP = "thinking-budget-test"
QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]
BUDGET, MAX_TOKENS = 1024, 1060


@pytest.fixture(scope="module")
def base_url(serve_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from ray import serve

    from cluster.config import KVServeConfig
    from tests.integration.tiny_app import deploy
    from tests.support.tiny_served_model import CHAT_TEMPLATE, make_served_model

    from transformers import AutoTokenizer

    model_dir = make_served_model(tmp_path_factory.mktemp("budget") / "model", weights=long_context_llama)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    tokenizer.chat_template = CHAT_TEMPLATE.replace("'<|assistant|>\\n'", "'<|assistant|>\\n<think>\\n'")
    assert tokenizer.chat_template != CHAT_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    config = KVServeConfig.from_dict({
        "app_name": APP, "route_prefix": f"/{APP}",
        "model": {"path": str(model_dir), "served_model_name": MODEL},
        "engine": {"block_size": 16, "num_blocks": 160, "max_model_len": 2048, "max_num_seqs": 4,
                   "device": "cpu", "dtype": "float32", "num_threads": 1},
        "workers": {"num_replicas": 1, "num_cpus": 1, "stream_interval_ms": 0},
        "ingress": {"num_cpus": 0.5, "request_timeout_s": 300, "api_keys_env": None},
    })
    deploy(config)
    try:
        yield f"{serve_cluster.http_url}/{APP}/v1"
    finally:
        serve.delete(APP)


def long_context_llama(out: Path, vocab_size: int) -> None:
    """The tiny random Llama with room for a budget of BUDGET tokens and an answer."""
    from tests.support.tiny_models import make_tiny_model

    make_tiny_model("llama", out, vocab_size=vocab_size)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (out / "config.json").write_text(json.dumps(config))


def greedy_text(base_url: str, max_tokens: int) -> str:
    """The model's own output for the rendered prompt, no parser or budget in the way."""
    ids = httpx.post(base_url.removesuffix("/v1") + "/tokenize", json={"model": MODEL, "messages": QUESTION},
                     timeout=60).json()["tokens"]
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as client:
        return client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=max_tokens,
                                          extra_body={"ignore_eos": True}).choices[0].text


def test_budget_closes_the_thinking_block(base_url: str) -> None:
    unbounded, within = greedy_text(base_url, MAX_TOKENS), greedy_text(base_url, BUDGET)
    assert "</think>" not in unbounded  # the model alone thinks to the end
    with anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=300) as claude:
        kwargs: dict[str, Any] = {"model": MODEL, "messages": QUESTION, "max_tokens": MAX_TOKENS,
                                  "thinking": {"type": "enabled", "budget_tokens": BUDGET}, "extra_body": {"temperature": 0}}
        out = claude.messages.create(**kwargs)
        if out.stop_reason == "end_turn":  # the answer may end on EOS: it is there either way
            assert out.usage.output_tokens < MAX_TOKENS
        assert [block.type for block in out.content] == ["thinking", "text"]
        assert out.content[0].thinking == within  # type: ignore[union-attr]
        assert out.content[1].text  # type: ignore[union-attr]
        with claude.messages.stream(**kwargs) as stream:
            final = stream.get_final_message()
        assert [b.model_dump(include={"type", "text", "thinking"}) for b in final.content] == [
            b.model_dump(include={"type", "text", "thinking"}) for b in out.content]


@pytest.mark.parametrize(("thinking", "words"), [
    ({"type": "enabled", "budget_tokens": 1000}, "greater than or equal to 1024"),
    ({"type": "enabled", "budget_tokens": MAX_TOKENS}, "`max_tokens` must be greater than `thinking.budget_tokens`"),
])
def test_bad_budgets_are_anthropic_400s(base_url: str, thinking: dict[str, Any], words: str) -> None:
    with anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=60) as claude:
        with pytest.raises(anthropic.BadRequestError) as info:
            claude.messages.create(model=MODEL, messages=QUESTION, max_tokens=MAX_TOKENS, thinking=thinking)  # type: ignore[arg-type]
    body: Any = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert words in body["error"]["message"]
