"""Messages requests -> the chat conversation and request; chat answers -> Messages bodies,
stop reasons, the streamed event sequence and Anthropic's error shape."""
from __future__ import annotations

import json
from typing import Any

import pytest

from router import errors
from router.frontend.messages_api import translate as t
from router.frontend.messages_api.endpoint import authorization_of
from router.frontend.messages_api.errors import error_body
from router.frontend.messages_api.events import MessageEvents
from router.frontend.messages_api.protocol import MessagesRequest
from router.frontend.openai_api import protocol as p


def request(**fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 5, **fields})


def test_blocks_become_the_chat_turns() -> None:
    req = request(system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]},
            {"type": "text", "text": "Thanks"}]},
    ])
    assert t.chat_messages(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "user", "content": "Thanks"},
    ]


def test_request_renames_onto_chat() -> None:
    req = request(messages=[{"role": "user", "content": "hi"}], stop_sequences=["END"], temperature=0.5, top_k=4,
                  metadata={"user_id": "u1"},
                  tools=[{"name": "f", "input_schema": {"type": "object"}}],
                  tool_choice={"type": "tool", "name": "f", "disable_parallel_tool_use": True})
    chat = t.chat_request(req, stream=True)
    assert chat.max_completion_tokens == 5 and chat.stop == ["END"] and chat.temperature == 0.5 and chat.top_k == 4
    assert chat.user == "u1" and chat.stream and chat.parallel_tool_calls is False
    assert isinstance(chat.tool_choice, p.NamedToolChoice) and chat.tool_choice.function.name == "f"
    for kind, expected in (("auto", "auto"), ("any", "required"), ("none", "none")):
        assert t.chat_request(request(messages=[{"role": "user", "content": "hi"}], tools=[{"name": "f", "input_schema": {}}],
                                      tool_choice={"type": kind})).tool_choice == expected


@pytest.mark.parametrize("content", [
    [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}],
    [{"type": "document", "source": {}}],
    [{"type": "tool_use", "id": "x", "name": "f", "input": {}}],  # a user's tool_use
    [{"type": "tool_result", "content": "no id"}],
])
def test_unsupported_blocks_are_400(content: list[dict[str, Any]]) -> None:
    with pytest.raises(errors.APIError) as info:
        t.chat_request(request(messages=[{"role": "user", "content": content}]))
    assert info.value.status == 400
    assert error_body(info.value) == {"type": "error", "error": {"type": "invalid_request_error", "message": info.value.message}}


def test_stop_reasons_and_usage() -> None:
    assert t.stop_reason("length", None, False) == ("max_tokens", None)
    assert t.stop_reason("stop", None, True) == ("tool_use", None)
    assert t.stop_reason("stop", "END", False) == ("stop_sequence", "END")
    assert t.stop_reason("stop", 2, False) == ("end_turn", None)  # the EOS token id
    usage = p.Usage(prompt_tokens=10, completion_tokens=3, total_tokens=13, prompt_tokens_details=p.PromptTokensDetails(cached_tokens=4))
    assert t.usage_body(usage) == {"input_tokens": 6, "output_tokens": 3, "cache_read_input_tokens": 4, "cache_creation_input_tokens": 0}
    message = p.ChatResponseMessage(content="ok", tool_calls=[p.ToolCall(id="c", function=p.FunctionCall(name="f", arguments="{\"a\": 1}"))])
    assert t.content_blocks(message) == [{"type": "text", "text": "ok"}, {"type": "tool_use", "id": "c", "name": "f", "input": {"a": 1}}]


def test_x_api_key_is_a_bearer_token() -> None:
    assert authorization_of({"x-api-key": "k"}) == "Bearer k"
    assert authorization_of({"authorization": "Bearer b", "x-api-key": "k"}) == "Bearer b"
    assert authorization_of({}) is None
    assert error_body(errors.APIError(401, "no", "invalid_request_error"))["error"]["type"] == "authentication_error"
    assert error_body(errors.overloaded(3))["error"]["type"] == "rate_limit_error"


def _chunk(content: str | None = None, call: p.DeltaToolCall | None = None) -> p.ChatCompletionChunk:
    delta = p.ChatDelta(content=content, tool_calls=[call] if call else None)
    return p.ChatCompletionChunk(id="c", created=0, model="m", choices=[p.ChatChunkChoice(index=0, delta=delta)])


def test_stream_events_in_the_spec_order() -> None:
    events = MessageEvents("msg_1", "m")
    texts = events.start({"input_tokens": 3}) + events.chunk(_chunk("Hi")) + events.chunk(_chunk(" there"))
    texts += events.chunk(_chunk(call=p.DeltaToolCall(index=0, id="c1", type="function", function=p.DeltaFunctionCall(name="f", arguments=""))))
    texts += events.chunk(_chunk(call=p.DeltaToolCall(index=0, function=p.DeltaFunctionCall(arguments="{}"))))
    texts += events.finish("tool_calls", None, {"output_tokens": 4})
    parsed = [json.loads(x.split("data: ", 1)[1]) for x in texts]
    assert [(e["type"], e.get("index")) for e in parsed] == [
        ("message_start", None), ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("message_delta", None), ("message_stop", None),
    ]
    assert parsed[6]["delta"] == {"type": "input_json_delta", "partial_json": "{}"}
    assert parsed[8]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None} and parsed[8]["usage"] == {"output_tokens": 4}


def test_reasoning_becomes_thinking_blocks() -> None:
    message = p.ChatResponseMessage(content="Hi", reasoning_content="hmm")
    assert t.content_blocks(message) == [{"type": "thinking", "thinking": "hmm", "signature": ""}, {"type": "text", "text": "Hi"}]
    events = MessageEvents("msg_1", "m")
    chunk = p.ChatCompletionChunk(id="c", created=0, model="m", choices=[
        p.ChatChunkChoice(index=0, delta=p.ChatDelta(reasoning_content="hm", content="Hi"))])
    parsed = [json.loads(x.split("data: ", 1)[1]) for x in events.chunk(chunk)]
    assert [e["type"] for e in parsed] == ["content_block_start", "content_block_delta", "content_block_stop",
                                           "content_block_start", "content_block_delta"]
    assert parsed[1]["delta"] == {"type": "thinking_delta", "thinking": "hm"}
    req = request(messages=[{"role": "user", "content": "hi"}], thinking={"type": "enabled", "budget_tokens": 2000},
                  max_tokens=4096)
    chat = t.chat_request(req)
    assert chat.chat_template_kwargs == {"enable_thinking": True} and chat.thinking_token_budget == 2000
    plain = t.chat_request(request(messages=[{"role": "user", "content": "hi"}], thinking={"type": "disabled"}))
    assert plain.chat_template_kwargs == {"enable_thinking": False} and plain.thinking_token_budget is None


@pytest.mark.parametrize(("thinking", "max_tokens", "words"), [
    ({"type": "enabled"}, 4096, "budget_tokens: Field required"),
    ({"type": "enabled", "budget_tokens": 1023}, 4096, "greater than or equal to 1024"),
    ({"type": "enabled", "budget_tokens": 2048}, 2048, "`max_tokens` must be greater than `thinking.budget_tokens`"),
    ({"type": "disabled", "budget_tokens": 2048}, 4096, "only thinking of type 'enabled' takes a budget"),
])
def test_bad_thinking_budgets_are_400(thinking: dict[str, Any], max_tokens: int, words: str) -> None:
    body = {"model": "m", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}], "thinking": thinking}
    with pytest.raises(errors.APIError) as info:
        errors.validated(MessagesRequest, body)
    assert info.value.status == 400 and words in info.value.message
    assert error_body(info.value)["error"]["type"] == "invalid_request_error"


def test_forced_tool_use_refuses_thinking() -> None:
    body = {"model": "m", "max_tokens": 4096, "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "enabled", "budget_tokens": 1024}, "tool_choice": {"type": "any"},
            "tools": [{"name": "f", "input_schema": {"type": "object"}}]}
    with pytest.raises(errors.APIError) as info:
        errors.validated(MessagesRequest, body)
    assert "tool_choice forces tool use" in info.value.message
