"""Security findings on the HTTP input path (issue 30, "Exposure and limits"): each test
names the finding it pins. Bodies an attacker controls end in 4xx, never 500."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import pytest

from router.errors import APIError
from router.frontend.openai_api import protocol as p
from router.frontend.tool_calling import chat_tools
from router.frontend.auth import ApiKeys, hash_key
from router.frontend.openai_api.http_body import read_json
from router.frontend.ingress import Ingress
from worker.api import MAX_STRUCTURED_SPEC_CHARS


class SlowRequest:
    """A body that sends a few bytes and then nothing more (a slowloris client)."""

    def __init__(self, first: bytes) -> None:
        self._first = first
        self.headers: dict[str, str] = {}

    async def stream(self) -> AsyncIterator[bytes]:
        yield self._first
        await asyncio.Event().wait()  # never set: the client stalls
        yield b""


class WholeRequest:
    def __init__(self, body: bytes, authorization: str | None = None) -> None:
        self._body = body
        self.headers = {"authorization": authorization} if authorization else {}

    async def stream(self) -> AsyncIterator[bytes]:
        yield self._body


def status_of(coro: Any) -> int:
    with pytest.raises(APIError) as info:
        asyncio.run(coro)
    return info.value.status


def test_deeply_nested_json_is_400_not_500() -> None:
    # Finding: nested JSON raised RecursionError in json.loads -> 500.
    body = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert status_of(read_json(WholeRequest(body), 4 * 1024**2)) == 400


def test_a_stalled_body_times_out_with_408() -> None:
    # Finding: no read timeout on slow request bodies (a client could hold a handler forever).
    assert status_of(read_json(SlowRequest(b'{"prompt": "'), 1000, read_timeout_s=0.05)) == 408


def chat(**extra: object) -> p.ChatCompletionRequest:
    return p.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}], **extra})


def test_oversized_tool_choice_constraint_is_400_not_500() -> None:
    # Finding: a required tool_choice whose schema is over the spec cap raised
    # SamplingParamsError outside the 400 mapping -> 500.
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 64} for i in range(MAX_STRUCTURED_SPEC_CHARS // 64)}}
    req = chat(tools=[{"type": "function", "function": {"name": "f", "parameters": big}}], tool_choice="required")
    mode = chat_tools.tool_mode(req, "hermes", None)
    with pytest.raises(APIError) as info:
        chat_tools.chat_structured_output(req, mode)
    assert info.value.status == 400


def test_defs_in_tool_parameters_work_with_required_tool_choice() -> None:
    # Finding: `$ref: #/$defs/...` inside a tool's parameters pointed at the root of the
    # combined `required` schema, which has no $defs: the constraint failed to compile.
    params = {
        "type": "object",
        "$defs": {"unit": {"type": "string", "enum": ["c", "f"]}},
        "properties": {"unit": {"$ref": "#/$defs/unit"}},
        "required": ["unit"],
    }
    other = {"type": "object", "$defs": {"unit": {"type": "integer"}}, "properties": {"n": {"$ref": "#/$defs/unit"}}}
    req = chat(tools=[{"type": "function", "function": {"name": "temp", "parameters": params}},
                      {"type": "function", "function": {"name": "count", "parameters": other}}], tool_choice="required")
    so = chat_tools.chat_structured_output(req, chat_tools.tool_mode(req, "hermes", None))
    assert so is not None
    schema = json.loads(so.spec)
    jsonschema.validate([{"name": "temp", "parameters": {"unit": "c"}}], schema)
    jsonschema.validate([{"name": "count", "parameters": {"n": 3}}], schema)
    with pytest.raises(jsonschema.ValidationError):  # each tool keeps its own definitions
        jsonschema.validate([{"name": "count", "parameters": {"n": "c"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "temp", "parameters": {"unit": 3}}], schema)


def test_version_needs_the_key_when_keys_are_on() -> None:
    # Finding: README says every endpoint but /health needs a key; /version answered anyone.
    from tests.unit.router.frontend.grpc_api.test_grpc_servicer import FakeIngress

    ingress = object.__new__(Ingress)
    ingress.pipeline = FakeIngress(api_keys=ApiKeys([hash_key("k1")])).pipeline  # type: ignore[attr-defined]
    assert status_of(ingress.version(WholeRequest(b""))) == 401  # type: ignore[arg-type]
    ok = asyncio.run(ingress.version(WholeRequest(b"", "Bearer k1")))  # type: ignore[arg-type]
    assert ok.status_code == 200
