"""vLLM's utility endpoints (/tokenize, /detokenize, /version) and the sampling
parameters logit_bias and stop_token_ids, end to end with the official `openai` client
and httpx, on the whole Serve app (ingress + one worker) with the tiny model."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.integration.tiny_app import tiny_config

pytestmark = pytest.mark.integration

APP_NAME = "openai-params-test"
ROUTE_PREFIX = "/openai-params-test"
MODEL = "kv-tiny-params"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def served(serve_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    from ray import serve
    from transformers import AutoTokenizer

    from cluster.app import build_app
    from tests.support.tiny_served_model import make_served_model

    model_dir = make_served_model(tmp_path_factory.mktemp("served") / "tiny")
    serve.run(build_app(tiny_config(APP_NAME, model_dir, MODEL)), name=APP_NAME, route_prefix=ROUTE_PREFIX)
    try:
        yield f"{serve_cluster.http_url}{ROUTE_PREFIX}", AutoTokenizer.from_pretrained(model_dir)
    finally:
        serve.delete(APP_NAME)


@pytest.fixture
def http(served: tuple[str, Any]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served[0], timeout=60) as c:
        yield c


@pytest.fixture
def client(served: tuple[str, Any]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def greedy(client: openai.OpenAI, **extra: Any) -> Any:
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, **extra).choices[0]


# -- /tokenize, /detokenize, /version ----------------------------------------------------------
def test_tokenize_prompt_as_generation_does(http: httpx.Client, served: tuple[str, Any], client: openai.OpenAI) -> None:
    tokenizer = served[1]
    body = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert body["tokens"] == tokenizer(PROMPT).input_ids
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == client.models.list().data[0].model_extra["max_model_len"]
    bare = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False, "return_token_strs": True}).json()
    assert bare["tokens"] == tokenizer(PROMPT, add_special_tokens=False).input_ids
    assert len(bare["token_strs"]) == bare["count"]
    # The count is what usage reports for the same prompt.
    usage = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).usage
    assert usage.prompt_tokens == body["count"]


def test_tokenize_messages_matches_chat_usage(http: httpx.Client, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    body = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert body["count"] == usage.prompt_tokens


def test_detokenize_round_trip(http: httpx.Client, served: tuple[str, Any]) -> None:
    ids = served[1](PROMPT, add_special_tokens=False).input_ids
    assert http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json() == {"prompt": served[1].decode(ids)}


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/tokenize", {"model": MODEL}, 400),  # neither prompt nor messages
        ("/tokenize", {"model": MODEL, "prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400),
        ("/tokenize", {"model": "other", "prompt": "x"}, 404),
        ("/detokenize", {"model": MODEL, "tokens": [10**9]}, 400),
        ("/detokenize", {"model": MODEL, "tokens": [-1]}, 400),
        ("/detokenize", {"model": MODEL, "tokens": [1], "extra": 1}, 400),
    ],
)
def test_tokenize_errors(http: httpx.Client, path: str, body: dict[str, Any], status: int) -> None:
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]


def test_version(http: httpx.Client) -> None:
    body = http.get("/version").json()
    assert isinstance(body["version"], str) and body["version"]


# -- logit_bias ------------------------------------------------------------------------------------
def test_logit_bias_forces_a_token(client: openai.OpenAI, served: tuple[str, Any]) -> None:
    tokenizer = served[1]
    forced = tokenizer(" zebra", add_special_tokens=False).input_ids[-1]
    for temperature in (0.0, 1.0):
        choice = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, temperature=temperature, logit_bias={str(forced): 100},
            extra_body={"ignore_eos": True},
        ).choices[0]
        assert tokenizer(choice.text, add_special_tokens=False).input_ids.count(forced) >= 1
        assert choice.text == tokenizer.decode([forced] * 4)


def ids_of(tokenizer: Any, token_text: str) -> list[int]:
    """Every id whose text on its own is `token_text` (what the API's logprobs name)."""
    return [i for i in range(len(tokenizer)) if tokenizer.decode([i]) == token_text]


def test_logit_bias_bans_a_token(client: openai.OpenAI, served: tuple[str, Any]) -> None:
    plain = greedy(client, logprobs=0)
    first = ids_of(served[1], plain.logprobs.tokens[0])
    banned = greedy(client, logprobs=0, logit_bias={str(t): -100 for t in first})
    assert banned.logprobs.tokens[0] != plain.logprobs.tokens[0]


def test_logit_bias_on_chat(client: openai.OpenAI, served: tuple[str, Any]) -> None:
    forced = served[1](" zebra", add_special_tokens=False).input_ids[-1]
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, logit_bias={str(forced): 100},
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].message.content == served[1].decode([forced] * 3)


@pytest.mark.parametrize("bias", [{"5": 101}, {"abc": 1}, {str(10**9): 1}])
def test_bad_logit_bias_is_400(client: openai.OpenAI, bias: dict[str, float]) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logit_bias=bias)
    assert info.value.body["param"] == "logit_bias"


# -- stop_token_ids -------------------------------------------------------------------------------
def test_stop_token_ids_end_generation(client: openai.OpenAI, served: tuple[str, Any]) -> None:
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
                                      extra_body={"ignore_eos": True}).choices[0]
    assert plain.finish_reason == "length"
    stop_ids = ids_of(served[1], plain.logprobs.tokens[2])
    choice = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True, "stop_token_ids": stop_ids}).choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] in stop_ids
    assert plain.text.startswith(choice.text) and len(choice.text) < len(plain.text)


def test_stop_token_ids_on_chat(client: openai.OpenAI, served: tuple[str, Any]) -> None:
    forced = served[1](" zebra", add_special_tokens=False).input_ids[-1]
    choice = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=8, temperature=0,
        logit_bias={str(forced): 100}, extra_body={"stop_token_ids": [forced], "ignore_eos": True},
    ).choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == forced
    assert choice.message.content == served[1].decode([forced])


# -- echo --------------------------------------------------------------------------------------------
def test_echo_prepends_the_prompt(client: openai.OpenAI, http: httpx.Client, served: tuple[str, Any]) -> None:
    plain = greedy(client)
    echoed = greedy(client, echo=True)
    assert echoed.text == PROMPT + plain.text
    ids = served[1](PROMPT).input_ids
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, echo=True).choices[0]
    assert by_ids.text == served[1].decode(ids) + plain.text
    # Streamed: the prompt comes first, then the completion.
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == PROMPT + plain.text


# -- prompt logprobs and echo with logprobs (the engine's values are HF-exact: tests/unit/worker/sampling/test_prompt_logprobs_vs_hf.py)
def test_echo_with_logprobs_leads_with_the_prompt_tokens(client: openai.OpenAI, served: tuple[str, Any]) -> None:
    num_prompt = len(served[1](PROMPT).input_ids)
    plain = greedy(client, logprobs=2)
    echoed = greedy(client, echo=True, logprobs=2, extra_body={"prompt_logprobs": 3})
    assert echoed.text == PROMPT + plain.text
    lp = echoed.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == num_prompt + len(plain.logprobs.tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.tokens[num_prompt:] == plain.logprobs.tokens
    assert lp.token_logprobs[num_prompt:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    assert all(len(top) <= 2 for top in lp.top_logprobs[1:])  # echo's k, not prompt_logprobs' 3
    assert lp.text_offset == sorted(lp.text_offset)
    # vLLM's prompt_logprobs agree with the echoed values, token by token.
    prompt_lp = echoed.model_extra["prompt_logprobs"]
    assert len(prompt_lp) == num_prompt and prompt_lp[0] is None
    ids = served[1](PROMPT).input_ids
    for q in range(1, num_prompt):
        entry = prompt_lp[q][str(ids[q])]
        assert entry["logprob"] == pytest.approx(lp.token_logprobs[q], abs=1e-6)
        assert entry["rank"] >= 1 and entry["decoded_token"] == served[1].decode([ids[q]])
        assert len(prompt_lp[q]) in (3, 4)  # top-3, plus the token when it is not among them
        assert all(1 <= e["rank"] <= 3 for k, e in prompt_lp[q].items() if k != str(ids[q]))
    # Streamed: the echo (with its logprobs) leads the first chunk.
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=2, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == PROMPT + plain.text
    streamed = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_prompt_logprobs_on_chat(client: openai.OpenAI, http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Say hi"}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    prompt_lp = response.model_extra["prompt_logprobs"]
    assert len(prompt_lp) == response.usage.prompt_tokens and prompt_lp[0] is None
    assert all(len(row) == 1 for row in prompt_lp[1:])  # k=0: the prompt token alone
    assert response.usage.prompt_tokens_details.cached_tokens == 0  # never read from the cache
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "stream": True, "prompt_logprobs": 1})
    assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"].lower()
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "prompt_logprobs": 21})
    assert r.status_code == 400
