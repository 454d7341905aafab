"""/v1/messages and /v1/messages/count_tokens end to end with the official `anthropic`
client on the whole Serve app and the embedded kvserve-tiny model, API keys on: plain,
system, streamed, a forced tool_use then its tool_result, stop sequences, count_tokens,
x-api-key beside the bearer token, and Anthropic's error shape. Each answer is held to what
/v1/chat/completions gives for the same conversation (greedy: same text, same tokens)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.integration.agent_app import KEY_ALPHA, MODEL, agent_app

pytestmark = pytest.mark.integration

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
           "required": ["city"], "additionalProperties": False}
TOOLS: list[Any] = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}}]
GREEDY: dict[str, Any] = {"max_tokens": 12, "extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def base_url(serve_cluster: Any) -> Iterator[str]:
    with agent_app(serve_cluster, "messages-api-test") as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key=KEY_ALPHA, max_retries=0, timeout=300) as c:
        yield c


def chat(base_url: str, messages: list[dict[str, Any]], **kw: Any) -> Any:
    with openai.OpenAI(base_url=base_url, api_key=KEY_ALPHA, max_retries=0, timeout=300) as c:
        return c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_completion_tokens=12, **kw)


def test_plain_and_system_match_chat(client: anthropic.Anthropic, base_url: str) -> None:
    out = client.messages.create(model=MODEL, messages=[{"role": "user", "content": "Tell me about Oslo."}], **GREEDY)
    same = chat(base_url, [{"role": "user", "content": "Tell me about Oslo."}])
    assert out.type == "message" and out.role == "assistant" and out.model == MODEL
    assert out.content[0].type == "text" and out.content[0].text == same.choices[0].message.content
    assert out.stop_reason == ("max_tokens" if same.choices[0].finish_reason == "length" else "end_turn")
    assert out.usage.input_tokens + (out.usage.cache_read_input_tokens or 0) == same.usage.prompt_tokens
    assert out.usage.output_tokens == same.usage.completion_tokens
    out = client.messages.create(model=MODEL, system="Answer briefly.", **GREEDY,
                                 messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    same = chat(base_url, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}])
    assert out.content[0].text == same.choices[0].message.content


def test_stop_sequence(client: anthropic.Anthropic) -> None:
    messages: list[Any] = [{"role": "user", "content": "Tell me about Oslo."}]
    text = client.messages.create(model=MODEL, messages=messages, **GREEDY).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    out = client.messages.create(model=MODEL, messages=messages, stop_sequences=[stop], **GREEDY)
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert stop not in out.content[0].text and text.startswith(out.content[0].text)


def test_stream_event_sequence(client: anthropic.Anthropic, base_url: str) -> None:
    with client.messages.stream(model=MODEL, messages=[{"role": "user", "content": "Count to five."}], **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if not e.type.startswith(("text", "input_json"))]  # the helper's own events apart
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert final.content[0].text == text == chat(base_url, [{"role": "user", "content": "Count to five."}]).choices[0].message.content
    assert final.usage.output_tokens > 0 and final.stop_reason in ("end_turn", "max_tokens")


def test_tool_use_then_tool_result(client: anthropic.Anthropic, base_url: str) -> None:
    question = {"role": "user", "content": "Weather in Oslo?"}
    first = client.messages.create(model=MODEL, messages=[question], tools=TOOLS, max_tokens=60,
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})
    assert first.stop_reason == "tool_use"
    use = [b for b in first.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather"
    jsonschema.validate(use[0].input, WEATHER)
    second = client.messages.create(model=MODEL, tools=TOOLS, **GREEDY, messages=[
        question, {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "Sunny, 21 C"}]},
    ])
    same = chat(base_url, [question, {"role": "assistant", "content": None, "tool_calls": [
        {"id": use[0].id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(use[0].input)}}]},
        {"role": "tool", "tool_call_id": use[0].id, "content": "Sunny, 21 C"}], tools=CHAT_TOOLS)
    assert second.usage.input_tokens + (second.usage.cache_read_input_tokens or 0) == same.usage.prompt_tokens
    assert "".join(b.text for b in second.content if b.type == "text") == (same.choices[0].message.content or "")


def test_streamed_any_tool(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, max_tokens=150,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    jsonschema.validate([b for b in final.content if b.type == "tool_use"][0].input, WEATHER)


def test_count_tokens_and_x_api_key(client: anthropic.Anthropic, base_url: str) -> None:
    messages: list[Any] = [{"role": "user", "content": "Tell me about Oslo."}]
    count = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages)
    assert count.input_tokens == chat(base_url, [{"role": "system", "content": "Be brief."}, *messages]).usage.prompt_tokens
    with httpx.Client(base_url=base_url.removesuffix("/v1"), timeout=60) as http:
        ok = http.post("/v1/messages/count_tokens", headers={"x-api-key": KEY_ALPHA}, json={"model": MODEL, "messages": messages})
        assert ok.status_code == 200 and ok.json() == {"input_tokens": chat(base_url, messages).usage.prompt_tokens}
        denied = http.post("/v1/messages", headers={"x-api-key": "wrong"}, json={"model": MODEL, "max_tokens": 4, "messages": messages})
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("fields", [
    {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]},
    {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    {"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "tool", "name": "nope"}},
    {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.5},
    {"messages": [{"role": "robot", "content": "hi"}]},
    {"messages": []},
])
def test_bad_input_is_a_400_in_anthropic_shape(client: anthropic.Anthropic, fields: dict[str, Any]) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        client.post("/v1/messages", body={"model": MODEL, "max_tokens": 4, **fields}, cast_to=object)
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"]


def test_unknown_model_is_a_404_in_anthropic_shape(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
