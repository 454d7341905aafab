"""Responses input items -> the chat conversation; the Responses request -> the chat
request; a chat stream -> the Responses event sequence."""
from __future__ import annotations

import json
from typing import Any

import pytest

from router import errors
from router.frontend.openai_api import protocol as p
from router.frontend.responses_api import translate as t
from router.frontend.responses_api.events import ResponseEvents
from router.frontend.responses_api.items import chat_messages
from router.frontend.responses_api.protocol import ResponsesRequest


def test_items_become_the_chat_turns() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "in Oslo?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
    ]
    assert chat_messages(items) == [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
    ]
    assert chat_messages("hi") == [{"role": "user", "content": "hi"}]
    # A turn's output items read back as the chat message that turn was.
    message = p.ChatResponseMessage(content="ok", tool_calls=[p.ToolCall(id="c9", function=p.FunctionCall(name="f", arguments="{}"))])
    assert chat_messages(t.output_items(message)) == [
        {"role": "assistant", "content": "ok", "tool_calls": [{"id": "c9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]


@pytest.mark.parametrize("items", [
    [{"type": "input_image", "image_url": "x"}],
    [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
    [{"role": "robot", "content": "hi"}],
    [{"type": "function_call", "name": "f", "arguments": "{}"}],
    [{"type": "item_reference", "id": "msg_1"}],
])
def test_unsupported_items_are_400(items: list[dict[str, Any]]) -> None:
    with pytest.raises(errors.APIError) as info:
        chat_messages(items)
    assert info.value.status == 400 and info.value.param is not None and info.value.param.startswith("input[0]")


def test_request_renames_onto_chat() -> None:
    req = ResponsesRequest.model_validate({
        "model": "m", "instructions": "Be brief.", "input": "hi", "max_output_tokens": 7, "temperature": 0,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
        "reasoning": {"effort": "low"}, "top_logprobs": 2,
    })
    chat = t.chat_request(req, [{"role": "assistant", "content": "earlier"}], stream=True)
    assert [(m.role, m.text()) for m in chat.messages] == [("system", "Be brief."), ("assistant", "earlier"), ("user", "hi")]
    assert chat.max_completion_tokens == 7 and chat.temperature == 0 and chat.stream and chat.parallel_tool_calls is False
    assert chat.tools is not None and chat.tools[0].function.name == "f" and chat.tools[0].function.strict is True
    assert isinstance(chat.tool_choice, p.NamedToolChoice) and chat.tool_choice.function.name == "f"
    assert chat.reasoning_effort == "low" and chat.logprobs and chat.top_logprobs == 2
    fmt = ResponsesRequest.model_validate({"model": "m", "input": "x", "text": {"format": {
        "type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}}})
    assert t.chat_request(fmt, [], False).response_format == {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}, "strict": True}}
    # A forced call is the turn's whole output: the text format waits for a text turn.
    forced = fmt.model_copy(update={"tools": req.tools, "tool_choice": "required"})
    assert t.chat_request(forced, [], False).response_format is None


def _chunk(content: str | None = None, call: p.DeltaToolCall | None = None) -> p.ChatCompletionChunk:
    delta = p.ChatDelta(content=content, tool_calls=[call] if call else None)
    return p.ChatCompletionChunk(id="c", created=0, model="m", choices=[p.ChatChunkChoice(index=0, delta=delta)])


def test_stream_events_in_the_spec_order() -> None:
    req = ResponsesRequest.model_validate({"model": "m", "input": "hi"})
    events = ResponseEvents(lambda *a: t.response_body("resp_1", req, "m", 0, len, *a))
    texts = events.start() + events.chunk(_chunk("Hel")) + events.chunk(_chunk("lo"))
    texts += events.chunk(_chunk(call=p.DeltaToolCall(index=0, id="c1", type="function",
                                                      function=p.DeltaFunctionCall(name="f", arguments=""))))
    texts += events.chunk(_chunk(call=p.DeltaToolCall(index=0, function=p.DeltaFunctionCall(arguments="{}"))))
    closing, response = events.finish("tool_calls", {"input_tokens": 1, "output_tokens_details": {"reasoning_tokens": 0}})
    closing.append(events.done(response))
    parsed = [json.loads(x.split("data: ", 1)[1]) for x in texts + closing]
    assert [e["type"] for e in parsed] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]
    assert all(x.startswith(f"event: {e['type']}\n") for x, e in zip(texts + closing, parsed))
    assert [e["sequence_number"] for e in parsed] == list(range(len(parsed)))
    assert response["status"] == "completed" and [i["type"] for i in response["output"]] == ["message", "function_call"]
    assert response["output"][0]["content"][0]["text"] == "Hello" and response["output"][1]["arguments"] == "{}"
    cut = ResponseEvents(lambda *a: t.response_body("resp_2", req, "m", 0, len, *a))
    closing, response = cut.finish("length", {"output_tokens_details": {}})
    closing.append(cut.done(response))
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert json.loads(closing[-1].split("data: ", 1)[1])["type"] == "response.incomplete"


def test_reasoning_becomes_a_reasoning_item_whole_and_streamed() -> None:
    message = p.ChatResponseMessage(content="Hi", reasoning_content="think")
    items = t.output_items(message)
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert chat_messages(items) == [{"role": "assistant", "content": "Hi"}]  # past thinking is not replayed
    req = ResponsesRequest.model_validate({"model": "m", "input": "hi"})
    events = ResponseEvents(lambda *a: t.response_body("resp_1", req, "m", 0, len, *a))
    reasoning_chunk = p.ChatCompletionChunk(id="c", created=0, model="m", choices=[
        p.ChatChunkChoice(index=0, delta=p.ChatDelta(reasoning_content="thi"))])
    texts = events.start() + events.chunk(reasoning_chunk) + events.chunk(_chunk("Hi"))
    closing, response = events.finish("stop", {"output_tokens_details": {"reasoning_tokens": 0}})
    closing.append(events.done(response))
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == len("thi")  # `len` counts here
    kinds = [json.loads(x.split("data: ", 1)[1])["type"] for x in texts + closing]
    assert kinds[2:6] == ["response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.done",
                          "response.output_item.done"]
    assert response["output"][0]["content"] == [{"type": "reasoning_text", "text": "thi"}]
