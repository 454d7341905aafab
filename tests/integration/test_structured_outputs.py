"""Structured outputs end to end with the official `openai` client on the whole Serve app
and the embedded kvserve-tiny model, whose output is gibberish, so every valid JSON below
is the grammar's doing. 32 schemas, each greedy non-streamed and sampled streamed, all
at once and beside unconstrained requests; regex / choice / grammar; invalid specs 400.

An output cut by max_tokens is finish_reason "length" and may be incomplete (as in
vLLM): every "stop" output must validate, and nearly all must stop.
"""
from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest

from tests.integration.structured_app import MODEL, structured_app

pytestmark = pytest.mark.integration

import openai

S = {"type": "string", "maxLength": 12}
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer"}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5}}, "required": ["x"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 20}}, "required": ["n"]},
    {"type": "object", "properties": {"p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}, "required": ["p"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["level"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"v": {"enum": [1, "a", None, True]}}, "required": ["v"]},
    {"type": "object", "properties": {"k": {"const": "fixed"}}, "required": ["k"]},
    {"type": "object", "properties": {"maybe": {"type": ["string", "null"], "maxLength": 5}}, "required": ["maybe"]},
    {"type": "object", "properties": {"a": S, "b": {"type": "integer"}}},  # all optional
    {"type": "object", "properties": {"a": S, "b": S, "c": {"type": "boolean"}}, "required": ["b"]},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"z": {"type": "integer"}}, "required": ["z"]}},
     "required": ["inner"]},
    {"type": "object", "properties": {"l1": {"type": "object", "properties": {"l2": {"type": "object", "properties": {
        "l3": {"type": "boolean"}}, "required": ["l3"]}}, "required": ["l2"]}}, "required": ["l1"]},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4}},
     "required": ["xs"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"people": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0}}, "required": ["name"]}}},
     "required": ["people"]},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}},
     "type": "object", "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}}, "required": ["from", "to"]},
    {"definitions": {"c": {"enum": ["x", "y"]}}, "type": "object", "properties": {"c": {"$ref": "#/definitions/c"}},
     "required": ["c"]},
    {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]}}, "required": ["id"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}, "required": ["code"]},
    {"type": "object", "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 4}}, "required": ["word"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 3},
    {"type": "integer", "minimum": 100, "maximum": 999},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "boolean"},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}], "items": False, "minItems": 2},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
               {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 100}, "label": S,
                                      "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
     "required": ["score", "label", "flags"]},
    {"type": "object", "properties": {"m": {"type": "object", "properties": {"k": {"enum": [1, 2]}},
                                            "required": ["k"], "additionalProperties": False}},
     "required": ["m"], "additionalProperties": False},
    {"type": "object", "properties": {"q": {"type": "integer", "maximum": -1}}, "required": ["q"]},
]
OPEN_SCHEMAS = {0, 11}  # these keep additionalProperties open (JSON schema's default)


def closed(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on its objects (as OpenAI's strict
    mode asks): an open object lets a model that never stops writing a new key run to
    max_tokens, and gibberish does exactly that. allOf branches stay as written."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k == "allOf" else closed(v)) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "allOf" not in out:
        out["additionalProperties"] = False
    return out


SCHEMAS = [s if i in OPEN_SCHEMAS else closed(s) for i, s in enumerate(SCHEMAS)]
MAX_TOKENS = 200
PROMPT = [{"role": "user", "content": "Tell me about the little cat in JSON."}]


@pytest.fixture(scope="module")
def base_url(serve_cluster: Any) -> Iterator[str]:
    with structured_app(serve_cluster, "structured-test") as url:
        yield url


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


async def _one(client: openai.AsyncOpenAI, schema: dict[str, Any] | None, greedy: bool, stream: bool, seed: int) -> tuple[str, str]:
    kwargs: dict[str, Any] = dict(model=MODEL, messages=PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=0.0 if greedy else 1.0, seed=seed)
    if schema is not None:
        kwargs["response_format"] = response_format(schema)
    if not stream:
        r = await client.chat.completions.create(**kwargs)
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    text, reason = "", ""
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


def test_32_schemas_greedy_and_sampled_streamed_and_not_beside_free_requests(base_url: str) -> None:
    assert len(SCHEMAS) >= 30
    for schema in SCHEMAS:
        jsonschema.validators.validator_for(schema).check_schema(schema)

    async def run() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600) as client:
            jobs = []
            for i, schema in enumerate(SCHEMAS):
                jobs.append(_one(client, schema, greedy=True, stream=i % 2 == 1, seed=i))
                jobs.append(_one(client, schema, greedy=False, stream=i % 2 == 0, seed=i))
            jobs += [_one(client, None, greedy=i % 2 == 0, stream=i % 3 == 0, seed=i) for i in range(8)]
            return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    constrained = results[: 2 * len(SCHEMAS)]
    stopped = 0
    for k, (text, reason) in enumerate(constrained):
        schema = SCHEMAS[k // 2]
        assert reason in ("stop", "length"), (schema, text, reason)
        if reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(text), schema)
    # Open objects (a new key at any point) and unbounded numbers (digits at any point)
    # can run to max_tokens under gibberish; most outputs finish.
    cut = [(k // 2, text[-40:]) for k, (text, reason) in enumerate(constrained) if reason != "stop"]
    assert stopped >= 0.7 * len(constrained), f"only {stopped} of {len(constrained)} finished; cut: {cut}"
    free = results[2 * len(SCHEMAS) :]
    assert all(reason in ("stop", "length") for _, reason in free)


def test_json_object_regex_choice_and_grammar(base_url: str) -> None:
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as client:
        r = client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                           response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
        r = client.completions.create(model=MODEL, prompt="The cat", max_tokens=20, temperature=1.0, seed=3,
                                      extra_body={"guided_regex": "[a-z]{3,6}-[0-9]{2}"})
        assert re.fullmatch("[a-z]{3,6}-[0-9]{2}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
        r = client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=10, temperature=1.0,
                                           extra_body={"guided_choice": ["sunny", "rainy", "cloudy"]})
        assert r.choices[0].message.content in ("sunny", "rainy", "cloudy")
        r = client.completions.create(model=MODEL, prompt="Say", max_tokens=30, temperature=1.0, seed=1,
                                      extra_body={"guided_grammar": 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/'})
        assert re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", r.choices[0].text) or r.choices[0].finish_reason == "length"
        r = client.completions.create(model=MODEL, prompt="Pick", max_tokens=10, temperature=1.0,
                                      extra_body={"structured_outputs": {"choice": ["left", "right"]}})
        assert r.choices[0].text in ("left", "right")


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": response_format({"type": "object", "properties": {"a": {"type": "frob"}}})},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"guided_json": "{not json"},
        {"guided_regex": "(unclosed"},
        {"guided_choice": []},
        {"guided_grammar": "start: missing_rule"},
        {"guided_regex": "a", "guided_choice": ["a"]},
    ],
)
def test_invalid_constraints_answer_400(base_url: str, extra: dict[str, Any]) -> None:
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 5, **extra}
    r = httpx.post(f"{base_url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
