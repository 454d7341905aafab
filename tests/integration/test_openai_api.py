"""The OpenAI-compatible HTTP API end to end: official `openai` client (sync and async),
raw httpx for the error paths, on the whole Serve app (ingress + one worker replica)
with a tiny random model. The app is deployed once for the module and deleted after it.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.integration.tiny_app import BLOCK_SIZE, NUM_BLOCKS, tiny_config  # 512 tokens of KV: the effective max_model_len

pytestmark = pytest.mark.integration

import openai

APP_NAME = "openai-api-test"
ROUTE_PREFIX = "/openai-api-test"
MODEL = "kv-tiny-test"
MAX_QUEUED = 4  # the ingress's in-flight bound (429 above it)
MAX_N = 4
MAX_BODY_BYTES = 64 * 1024


@dataclass
class Api:
    root: str  # http://127.0.0.1:PORT/openai-api-test
    tokenizer: Any

    @property
    def base_url(self) -> str:
        return f"{self.root}/v1"

    def worker_stats(self) -> dict[str, Any]:
        from ray import serve

        return serve.get_deployment_handle("worker", APP_NAME).stats.remote().result(timeout_s=30)


@pytest.fixture(scope="module")
def api(serve_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    from ray import serve
    from transformers import AutoTokenizer

    from cluster.app import build_app
    from tests.support.tiny_served_model import make_served_model

    model_dir = make_served_model(tmp_path_factory.mktemp("served") / "tiny")
    config = tiny_config(APP_NAME, model_dir, MODEL, ingress={
        "max_queued_requests": MAX_QUEUED, "max_n": MAX_N, "max_body_bytes": MAX_BODY_BYTES,
    })
    serve.run(build_app(config), name=APP_NAME, route_prefix=ROUTE_PREFIX)
    try:
        yield Api(f"{serve_cluster.http_url}{ROUTE_PREFIX}", AutoTokenizer.from_pretrained(model_dir))
    finally:
        serve.delete(APP_NAME)


@pytest.fixture
def client(api: Api) -> Iterator[Any]:
    with openai.OpenAI(base_url=api.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def http(api: Api) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api.root, timeout=60) as c:
        yield c


def prompt_len(api: Api, prompt: str) -> int:
    return len(api.tokenizer(prompt).input_ids)


def chat_prompt_len(api: Api, messages: list[dict[str, str]]) -> int:
    text = api.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(api.tokenizer(text, add_special_tokens=False).input_ids)


EXACT = {"ignore_eos": True}  # exactly max_tokens tokens, whatever the random model says


# -- completions -------------------------------------------------------------------------
def test_completion_text_and_usage(api: Api, client: Any) -> None:
    out = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0, extra_body=EXACT)
    assert out.object == "text_completion" and out.model == MODEL and len(out.choices) == 1
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == prompt_len(api, "Hello world")
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_completion_stream_matches_unary_and_reports_usage(api: Api, client: Any) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0, extra_body=EXACT)
    unary = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == unary.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt_len(api, "The quick brown fox"), 12)
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_ends_with_done(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(e.startswith("data: ") for e in events)
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 4


def test_n_choices_share_a_prompt(api: Api, client: Any) -> None:
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, n=2, seed=3, extra_body=EXACT)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.prompt_tokens == prompt_len(api, "Once upon a time")  # counted once
    assert out.usage.completion_tokens == 12


def test_seed_reproducible(client: Any) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, prompt="A serving cluster", max_tokens=10, temperature=1.0, seed=1234, extra_body=EXACT)
    first = client.completions.create(**kwargs).choices[0].text
    second = client.completions.create(**kwargs).choices[0].text
    assert first == second


def _stop_candidate(text: str) -> str | None:
    for k in range(len(text) // 3, len(text) - 2):
        candidate = text[k : k + 2]
        if "\ufffd" not in candidate and candidate.strip():
            return candidate
    return None


def test_stop_strings(client: Any) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, prompt="What is the capital", max_tokens=24, temperature=0, extra_body=EXACT)
    full = client.completions.create(**kwargs).choices[0].text
    stop = _stop_candidate(full)
    # The embedded model and greedy decoding are fixed, so this text is too.
    assert stop is not None, f"the model's text has no usable stop string: {full!r}"
    expected = full[: full.find(stop)]
    for stop_arg in (stop, [stop, "never-produced-#"]):
        out = client.completions.create(stop=stop_arg, **kwargs).choices[0]
        assert out.text == expected and out.finish_reason == "stop"


def test_completion_logprobs(client: Any) -> None:
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=2, extra_body=EXACT)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(x <= 0.0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0


# -- chat --------------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]


def test_chat_text_usage_and_logprobs(api: Api, client: Any) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=6, temperature=0, logprobs=True, top_logprobs=3, extra_body=EXACT
    )
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == chat_prompt_len(api, MESSAGES)
    assert out.usage.completion_tokens == 6
    content = choice.logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        # Greedy picks the most likely token: its logprob is the best of the top ones.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)


def test_chat_stream_with_usage(api: Api, client: Any) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, max_tokens=7, temperature=0, extra_body=EXACT)
    unary = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == unary.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == chat_prompt_len(api, MESSAGES)


async def test_async_client_completion_and_chat_stream(api: Api) -> None:
    async with openai.AsyncOpenAI(base_url=api.base_url, api_key="unused", max_retries=0, timeout=60) as aclient:
        out = await aclient.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, extra_body=EXACT)
        assert out.usage.completion_tokens == 5
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, n=2, stream=True, stream_options={"include_usage": True}, extra_body=EXACT
        )
        texts: dict[int, str] = {0: "", 1: ""}
        finish: dict[int, str] = {}
        usage = None
        async for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                if c.finish_reason:
                    finish[c.index] = c.finish_reason
            usage = chunk.usage or usage
        assert finish == {0: "length", 1: "length"}
        assert usage is not None and usage.completion_tokens == 10


async def test_async_concurrent_requests(api: Api) -> None:
    async with openai.AsyncOpenAI(base_url=api.base_url, api_key="unused", max_retries=0, timeout=60) as aclient:
        outs = await asyncio.gather(
            *[aclient.completions.create(model=MODEL, prompt=f"Numbers {i}", max_tokens=4, extra_body=EXACT) for i in range(3)]
        )
    assert [o.usage.completion_tokens for o in outs] == [4, 4, 4]


# -- errors ------------------------------------------------------------------------------
def assert_error(r: httpx.Response, status: int, param: str | None = "*", code: str | None = "*") -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param != "*":
        assert error["param"] == param
    if code != "*":
        assert error["code"] == code
    return error


def test_malformed_json_is_400(http: httpx.Client) -> None:
    r = http.post("/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert_error(r, 400, code="invalid_json")


def test_unknown_field_is_400(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "temperatur": 0.5})
    error = assert_error(r, 400, param="temperatur")
    assert "Unrecognized request argument" in error["message"]


def test_unknown_model_is_404(http: httpx.Client, client: Any) -> None:
    assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model", "model_not_found")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=MESSAGES)


def test_too_long_is_400(http: httpx.Client) -> None:
    # The pool holds 512 tokens: that is this server's context length.
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 600})
    error = assert_error(r, 400, "max_tokens", "context_length_exceeded")
    assert "512" in error["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": list(range(10, 10 + 520)), "max_tokens": 1})
    assert_error(r, 400, "prompt", "context_length_exceeded")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": 3.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": MAX_N + 1}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": [f"s{i}" for i in range(40)]}, "stop"),
    ],
)
def test_out_of_range_is_400(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", **body}), 400, param)


def test_worker_side_rejection_is_400(http: httpx.Client) -> None:
    # Token ids beyond the vocabulary: caught by the engine on the worker, still a 400.
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 5, 10**6], "max_tokens": 2})
    error = assert_error(r, 400)
    assert "token ids" in error["message"]


def test_oversized_body_is_413(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * (MAX_BODY_BYTES + 10)})
    assert_error(r, 413)


async def test_overload_is_429_and_server_recovers(api: Api) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 60, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=api.root, timeout=60) as ac:
        responses = await asyncio.gather(*[ac.post("/v1/completions", json=body) for _ in range(3 * MAX_QUEUED)])
        codes = [r.status_code for r in responses]
        assert codes.count(200) >= 1 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
        rejected = next(r for r in responses if r.status_code == 429)
        assert_error(rejected, 429, code="server_overloaded")
        again = await ac.post("/v1/completions", json={**body, "max_tokens": 2})
        assert again.status_code == 200


async def test_client_disconnect_aborts_and_frees_blocks(api: Api) -> None:
    before = await asyncio.to_thread(api.worker_stats)
    total = before["total_blocks"]
    # As many tokens as the context allows: the tiny model is fast, and the stream must
    # still be running when the client goes away (checked below by the token count).
    max_tokens = 480
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=api.root, timeout=60) as ac:
        async with ac.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            received = 0
            async for line in r.aiter_lines():
                received += bool(line)
                if received == 3:
                    break
        # Leaving the block closed the connection mid-stream (at once: no stats call
        # in between, which on an idle machine let the request run to its end).
    assert received == 3
    deadline = time.monotonic() + 20
    while True:
        stats = await asyncio.to_thread(api.worker_stats)
        if stats["free_blocks"] == total and stats["num_running"] == 0 and stats["num_waiting"] == 0:
            break
        assert time.monotonic() < deadline, f"blocks not freed after disconnect: {stats}"
        await asyncio.sleep(0.1)
    # Aborted, not run to completion.
    assert stats["num_generated_tokens"] - before["num_generated_tokens"] < max_tokens
    async with openai.AsyncOpenAI(base_url=api.base_url, api_key="unused", max_retries=0, timeout=60) as aclient:
        out = await aclient.completions.create(model=MODEL, prompt="Still there?", max_tokens=3, extra_body=EXACT)
    assert out.usage.completion_tokens == 3


# -- models, health, metrics --------------------------------------------------------------
def test_models(client: Any, http: httpx.Client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert http.get("/v1/models").json()["data"][0]["max_model_len"] == NUM_BLOCKS * BLOCK_SIZE


def test_health(http: httpx.Client) -> None:
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_metrics(client: Any, http: httpx.Client) -> None:
    client.completions.create(model=MODEL, prompt="metrics please", max_tokens=3, extra_body=EXACT)
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in (
        "kvserve:num_requests_running{",
        "kvserve:num_requests_waiting{",
        "kvserve:kv_cache_usage_perc{",
        "kvserve:prefix_cache_queries_total{",
        "kvserve:prefix_cache_hits_total{",
        "kvserve:num_preemptions_total{",
        "kvserve:prompt_tokens_total{",
        "kvserve:generation_tokens_total{",
        "kvserve:time_to_first_token_seconds_bucket{",
        "kvserve:inter_token_latency_seconds_bucket{",
        "kvserve:e2e_request_latency_seconds_bucket{",
        "kvserve:cluster_kv_cache_usage_perc{",
    ):
        assert name in text, name
    generated = [line for line in text.splitlines() if line.startswith("kvserve:generation_tokens_total{")]
    assert float(generated[0].rsplit(" ", 1)[1]) >= 3
    assert f'model_name="{MODEL}"' in text and 'replica="' in text


def test_unknown_path_is_openai_shaped_404(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing-here"), 404)
