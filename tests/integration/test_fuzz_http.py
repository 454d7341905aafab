"""Bad input on the OpenAI HTTP API: property-based fuzzing (hypothesis) of
/v1/completions and /v1/chat/completions on the whole app (ingress + a worker running a
tiny model), the body and list-length caps, tokenizer edge cases, and log hygiene.

Properties, for every body: the answer is never a 5xx, comes within the client timeout
(no hang), a 4xx carries an OpenAI error body, a 200 is a complete response (a stream
ends with [DONE] and carries no server error); afterwards the server still serves and
the worker holds no KV block. The number of fuzz cases tried is printed at the end
("FUZZ http cases=N") and kept in FUZZ_CASES.

Why no schemathesis: the ingress publishes no OpenAPI schema (openapi_url=None; the
handlers read the raw body to enforce the size cap before parsing), so the strategies
here are built from the pydantic request models' field names instead.
"""
from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

import hypothesis
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from router.frontend.openai_api import protocol as p  # noqa: E402
from tests.integration import tiny_app  # noqa: E402

pytestmark = pytest.mark.integration

APP = "fuzz-http"
MODEL = "tiny-fuzz"
MAX_BODY_BYTES = 64 * 1024
MAX_N = 4
TIMEOUT_S = 60.0  # a hang fails the example (httpx raises)
MARKER = f"PROMPTMARKER{uuid.uuid4().hex}"

FUZZ_CASES: Counter[str] = Counter()
FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
    print_blob=True,
)


@dataclass
class Api:
    root: str
    tokenizer: Any
    client: httpx.Client


@pytest.fixture(scope="module")
def api(serve_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    from ray import serve
    from transformers import AutoTokenizer

    from tests.support.tiny_served_model import make_served_model

    model_dir: Path = make_served_model(tmp_path_factory.mktemp("fuzz") / "tiny")
    config = tiny_config(model_dir)
    tiny_app.deploy(config)
    root = f"{serve_cluster.http_url}/{APP}"
    try:
        with httpx.Client(base_url=root, timeout=TIMEOUT_S) as client:
            yield Api(root, AutoTokenizer.from_pretrained(model_dir), client)
    finally:
        serve.delete(APP)


def tiny_config(model_dir: Path) -> Any:
    return tiny_app.tiny_config(
        APP, model_dir, MODEL,
        {"max_queued_requests": 64, "max_n": MAX_N, "max_body_bytes": MAX_BODY_BYTES},
    )


# -- the property every answer must have ---------------------------------------------------
def check_answer(api: Api, path: str, content: bytes, headers: dict[str, str] | None = None) -> int:
    """POST the body; assert the answer is well-formed and not a server error."""
    hdrs = {"content-type": "application/json", **(headers or {})}
    with api.client.stream("POST", path, content=content, headers=hdrs) as r:
        raw = r.read()
        status = r.status_code
        is_sse = r.headers.get("content-type", "").startswith("text/event-stream")
    assert status < 500, f"{status} for {content[:300]!r}: {raw[:500]!r}"
    if status != 200:
        error = json.loads(raw)["error"]
        assert isinstance(error["message"], str) and error["message"], raw
        return status
    if is_sse:
        events = [line for line in raw.decode().split("\n") if line]
        assert events[-1] == "data: [DONE]", events[-3:]
        for event in events[:-1]:
            payload = json.loads(event.removeprefix("data: "))
            assert "error" not in payload or payload["error"]["type"] != "server_error", payload
    else:
        body = json.loads(raw)
        assert body["choices"], body
    return status


# -- strategies ------------------------------------------------------------------------------
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=12), children, max_size=6),
    max_leaves=25,
)

COMPLETION_FIELDS = sorted(p.CompletionRequest.model_fields)
CHAT_FIELDS = sorted(p.ChatCompletionRequest.model_fields)

small_ints = st.integers(min_value=-3, max_value=40)
absurd_ints = st.sampled_from([0, -1, 2**31, 2**63, 2**64 + 1, 10**30, -(10**30)])
field_values = st.one_of(
    json_values,
    small_ints,
    absurd_ints,
    st.floats(min_value=-3, max_value=3),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308]),
    st.lists(st.text(max_size=8), max_size=40),  # stop lists, prompt lists: longer than the caps
    st.lists(st.integers(min_value=-5, max_value=2**33), max_size=80),
    st.lists(st.lists(st.integers(min_value=0, max_value=400), max_size=5), max_size=5),
    st.text(max_size=300),
)


def base_completion() -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello world", "max_tokens": 4}


def base_chat() -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    body = dict(base)
    for name in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=4, unique=True)):
        body[name] = draw(field_values)
    if draw(st.booleans()):
        body["stream"] = True
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.text(min_size=1, max_size=10))] = draw(json_values)  # unknown field
    if draw(st.integers(0, 9)) == 0:
        body.pop(draw(st.sampled_from(sorted(body))), None)
    # Keep generation short when the body is otherwise valid: the property is about
    # what the server does with the body, not about long generations on 2 CPU cores.
    if isinstance(body.get("max_tokens"), int) and 0 < body["max_tokens"] <= 2**20:
        body["max_tokens"] = min(body["max_tokens"], 24)
    return body


def dumps(body: Any) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


# -- fuzzing -------------------------------------------------------------------------------
@settings(FUZZ, max_examples=30)
@given(body=json_values)
def test_arbitrary_json_completions(api: Api, body: Any) -> None:
    FUZZ_CASES["arbitrary_json"] += 1
    check_answer(api, "/v1/completions", dumps(body))


@settings(FUZZ, max_examples=30)
@given(body=json_values)
def test_arbitrary_json_chat(api: Api, body: Any) -> None:
    FUZZ_CASES["arbitrary_json"] += 1
    check_answer(api, "/v1/chat/completions", dumps(body))


@settings(FUZZ, max_examples=45)
@given(body=mutated(base_completion(), COMPLETION_FIELDS))
def test_mutated_completions(api: Api, body: dict[str, Any]) -> None:
    FUZZ_CASES["mutated"] += 1
    check_answer(api, "/v1/completions", dumps(body))


@settings(FUZZ, max_examples=45)
@given(body=mutated(base_chat(), CHAT_FIELDS))
def test_mutated_chat(api: Api, body: dict[str, Any]) -> None:
    FUZZ_CASES["mutated"] += 1
    check_answer(api, "/v1/chat/completions", dumps(body))


@settings(FUZZ, max_examples=20)
@given(raw=st.binary(max_size=200), path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_raw_bytes(api: Api, raw: bytes, path: str) -> None:
    FUZZ_CASES["raw_bytes"] += 1
    check_answer(api, path, raw)


# -- caps ------------------------------------------------------------------------------------
def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text[:500])
    return r.json()["error"]


def test_oversized_body_is_413(api: Api) -> None:
    big = dumps({"model": MODEL, "prompt": "x" * (MAX_BODY_BYTES + 10)})
    assert error_of(api.client.post("/v1/completions", content=big), 413)["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the cap holds while reading
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    r = api.client.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert error_of(r, 413)["code"] == "request_too_large"
    # A lying Content-Length (smaller than the body) does not get past the cap either.
    r = api.client.post("/v1/completions", content=chunks())
    assert r.status_code == 413


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/completions", {"prompt": "Hello " * 700}, "prompt"),  # 512-token context
        ("/v1/completions", {"prompt": [1] * 600}, "prompt"),
        ("/v1/completions", {"max_tokens": 10**9}, "max_tokens"),
        ("/v1/completions", {"max_tokens": 2**64}, "max_tokens"),
        ("/v1/completions", {"n": 10**6}, "n"),
        ("/v1/completions", {"n": 2**70}, "n"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"stop": ["a"] * 17}, "stop"),
        ("/v1/completions", {"stop": "s" * 300}, None),
        ("/v1/completions", {"stop_token_ids": [3] * 65}, None),
        ("/v1/completions", {"stop_token_ids": [10**6]}, None),
        ("/v1/completions", {"prompt": [[1, 2]] * 300}, "prompt"),  # the number of prompts is bounded
        ("/v1/completions", {"prompt": ["hi"] * 20, "n": 4}, "prompt"),  # 80 completions > 64
        ("/v1/completions", {"seed": 2**63}, "seed"),
        ("/v1/completions", {"temperature": float("nan")}, "temperature"),
        ("/v1/chat/completions", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ("/v1/chat/completions", {"n": 5}, "n"),
        ("/v1/chat/completions", {"max_completion_tokens": 10**12}, None),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 2000}]}, None),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        # A client's own template would run on the ingress (this one loops 10^10 times).
        ("/v1/chat/completions", {"chat_template_kwargs": {"chat_template": "{% for i in range(100000) %}"
                                  "{% for j in range(100000) %}{% endfor %}{% endfor %}"}}, "chat_template_kwargs"),
        ("/v1/chat/completions", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ("/v1/chat/completions", {"chat_template_kwargs": {"x": {"nested": [1]}}}, "chat_template_kwargs"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None),
    ],
)
def test_caps_are_400(api: Api, path: str, fields: dict[str, Any], param: str | None) -> None:
    base = base_completion() if path == "/v1/completions" else base_chat()
    r = api.client.post(path, content=dumps({**base, **fields}), headers={"content-type": "application/json"})
    error = error_of(r, 400)
    if param is not None:
        assert error["param"] is not None and error["param"].split(".")[0] == param, error


# -- tokenizer edge cases -----------------------------------------------------------------
def post(api: Api, path: str, body: dict[str, Any] | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else dumps(body)
    return api.client.post(path, content=content, headers={"content-type": "application/json"})


def test_empty_prompts(api: Api) -> None:
    # "" still gets BOS: a one-token prompt, answered.
    assert post(api, "/v1/completions", {**base_completion(), "prompt": ""}).status_code == 200
    for prompt in ([], [[]], [""]):
        r = post(api, "/v1/completions", {**base_completion(), "prompt": prompt})
        assert r.status_code in (200, 400), r.text  # [""] is BOS only
    assert error_of(post(api, "/v1/completions", {**base_completion(), "prompt": []}), 400)
    assert error_of(post(api, "/v1/completions", {**base_completion(), "prompt": [[]]}), 400)
    chat = {**base_chat(), "messages": [{"role": "user", "content": ""}]}
    assert post(api, "/v1/chat/completions", chat).status_code == 200


def test_only_special_tokens(api: Api) -> None:
    specials = "<s></s><|user|><|assistant|><pad>"
    for extra in ({}, {"skip_special_tokens": False}, {"stream": True}):
        check_answer(api, "/v1/completions", dumps({**base_completion(), "prompt": specials, **extra}))
    ids = api.tokenizer.convert_tokens_to_ids(["<s>", "</s>", "<pad>"])
    check_answer(api, "/v1/completions", dumps({**base_completion(), "prompt": ids, "skip_special_tokens": False}))
    check_answer(api, "/v1/chat/completions", dumps({**base_chat(), "messages": [{"role": "user", "content": specials}]}))


LONE_SURROGATES = [
    b'{"model": "%s", "prompt": "Hello", "max_tokens": 4, "stop": ["\\ud800"]}',
    b'{"model": "%s", "prompt": "Hello", "max_tokens": 4, "stop": "a\\udfff", "stream": true}',
    b'{"model": "%s", "prompt": "Hello\\ud83d", "max_tokens": 4}',
    b'{"model": "%s", "prompt": ["\\udc00", "ok"], "max_tokens": 4}',
    b'{"model": "%s", "prompt": "Hello", "max_tokens": 4, "user": "\\ud800"}',
]
INVALID_UTF8 = [
    b'{"model": "%s", "prompt": "Hello", "max_tokens": 4, "stop": ["\xff\xfe"]}',
    b'{"model": "%s", "prompt": "\xc3\x28", "max_tokens": 4}',
]


@pytest.mark.parametrize("template", LONE_SURROGATES + INVALID_UTF8)
def test_invalid_unicode_is_never_a_server_error(api: Api, template: bytes) -> None:
    FUZZ_CASES["unicode"] += 1
    status = check_answer(api, "/v1/completions", template.replace(b"%s", MODEL.encode()))
    assert status in (200, 400)


def test_lone_surrogates_in_chat(api: Api) -> None:
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "hi \\ud800"}], "stop": ["\\udbff"], "max_tokens": 4}'
    assert check_answer(api, "/v1/chat/completions", raw.replace(b"%s", MODEL.encode())) in (200, 400)


def test_emoji_split_across_tokens(api: Api) -> None:
    emoji = "🙂🦙"
    ids = api.tokenizer(emoji, add_special_tokens=False).input_ids
    assert len(ids) > 2  # byte-level BPE: each emoji is several byte tokens
    # A prompt that ends half way through an emoji's bytes, and a stop string that is one.
    for prompt in (emoji, ids[:-1], ids[:1]):
        body = {**base_completion(), "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        unary = post(api, "/v1/completions", body)
        assert unary.status_code == 200, unary.text
        text = unary.json()["choices"][0]["text"]
        with api.client.stream("POST", "/v1/completions", content=dumps({**body, "stream": True})) as r:
            events = [line for line in r.iter_lines() if line]
        streamed = "".join(
            c["text"] for e in events[:-1] for c in json.loads(e.removeprefix("data: "))["choices"]
        )
        assert streamed == text
    body = {**base_completion(), "prompt": emoji, "stop": ["🦙", "\U0001F642"], "max_tokens": 8}
    assert post(api, "/v1/completions", body).status_code == 200


# -- after the storm -----------------------------------------------------------------------
def test_logs_never_contain_prompts(api: Api) -> None:
    """Prompts, stop strings, messages and bodies of valid and invalid requests stay out of
    every Ray log file at the default (INFO) level."""
    m = MARKER
    post(api, "/v1/completions", {**base_completion(), "prompt": f"{m} hello", "stop": [f"{m}-stop"]})
    post(api, "/v1/completions", {**base_completion(), "prompt": f"{m} again", "stream": True})
    post(api, "/v1/chat/completions", {**base_chat(), "messages": [{"role": "user", "content": f"{m} chat"}]})
    post(api, "/v1/completions", {**base_completion(), "prompt": f"{m} " * 600})  # 400: too long
    post(api, "/v1/completions", {**base_completion(), "prompt": m, "temperature": 9})  # 400: bad value
    post(api, "/v1/completions", {**base_completion(), m: m})  # 400: unknown field named by the marker
    post(api, "/v1/completions", f'{{"prompt": "{m}", '.encode())  # 400: broken JSON
    post(api, "/v1/chat/completions", {**base_chat(), "messages": [{"role": "user", "content": m}], "tools": [{m: 1}]})
    post(api, "/v1/completions", {**base_completion(), "prompt": m, "max_tokens": 4, "n": 99})
    # The marker does reach the logs when something logs it: the scan would see it.
    files = tiny_app.ray_log_files()
    found = tiny_app.files_containing([m, "API key authentication OFF"], files)
    assert "API key authentication OFF" in found, "the ingress's own log lines are not in the scanned files"
    assert m not in found, f"a prompt reached the logs: {found[m]}"


def test_still_serving_and_no_blocks_leaked(api: Api) -> None:
    tiny_app.wait_for(lambda: tiny_app.all_blocks_free(APP), "every KV block to be free after the fuzzing")
    assert api.client.get("/health").status_code == 200
    r = post(api, "/v1/completions", {**base_completion(), "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    total = sum(FUZZ_CASES.values())
    print(f"\nFUZZ http cases={total} " + " ".join(f"{k}={v}" for k, v in sorted(FUZZ_CASES.items())))
    assert total > 0
