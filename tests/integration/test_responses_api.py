"""/v1/responses end to end with the official `openai` client on the whole Serve app and
the embedded kvserve-tiny model (a chat template that renders tools), API keys on: plain,
instructions, streamed, forced tool calls then their outputs, previous_response_id,
retrieve and delete, another key's view, and the 400s. Each answer is held to what
/v1/chat/completions gives for the same conversation (greedy: the same text, the same
prompt tokens)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.integration.agent_app import KEY_ALPHA, KEY_BETA, MODEL, agent_app

pytestmark = pytest.mark.integration

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
           "required": ["city"], "additionalProperties": False}
TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 12}


class Answer(BaseModel):
    """The agent's output type in the Agents SDK test."""

    sky: Literal["sunny", "rainy"]


@pytest.fixture(scope="module")
def base_url(serve_cluster: Any) -> Iterator[str]:
    with agent_app(serve_cluster, "agent-apis-test") as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=base_url, api_key=KEY_ALPHA, max_retries=0, timeout=300) as c:
        yield c


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_completion_tokens=12, **kw)


def test_plain_and_instructions_match_chat(client: openai.OpenAI) -> None:
    out = client.responses.create(model=MODEL, input="Tell me about Oslo.", **GREEDY)
    same = chat(client, [{"role": "user", "content": "Tell me about Oslo."}])
    assert out.status in ("completed", "incomplete") and out.id.startswith("resp_")
    assert out.output_text == same.choices[0].message.content
    assert out.usage.input_tokens == same.usage.prompt_tokens and out.usage.output_tokens == same.usage.completion_tokens
    assert out.usage.input_tokens_details.cached_tokens >= 0
    assert (out.status == "incomplete") == (same.choices[0].finish_reason == "length")
    out = client.responses.create(model=MODEL, instructions="Answer briefly.",
                                  input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}], **GREEDY)
    same = chat(client, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}])
    assert out.output_text == same.choices[0].message.content and out.instructions == "Answer briefly."


def test_stream_event_sequence(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="Count to five.", stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if events[-1].response.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text == chat(client, [{"role": "user", "content": "Count to five."}]).choices[0].message.content
    assert final.usage.output_tokens > 0


def test_tool_call_then_output_continues_by_previous_response_id(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=TOOLS, temperature=0,
                                    max_output_tokens=60, tool_choice={"type": "function", "name": "get_weather"})
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=TOOLS, **GREEDY,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}],
    )
    # The same conversation through chat: same prompt tokens, same greedy text.
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].call_id, "type": "function",
                                                               "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "Sunny, 21 C"},
    ]
    same = chat(client, messages, tools=CHAT_TOOLS)
    assert second.usage.input_tokens == same.usage.prompt_tokens
    assert second.output_text == (same.choices[0].message.content or "")
    assert second.previous_response_id == first.id


def test_streamed_required_tool_call(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="Weather?", tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                          temperature=0, max_output_tokens=150, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert added and done and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == done[0].arguments
    jsonschema.validate(json.loads(done[0].arguments), WEATHER)


def test_json_schema_text_format(client: openai.OpenAI) -> None:
    out = client.responses.create(model=MODEL, input="A city, please.", temperature=0, max_output_tokens=60,
                                  text={"format": {"type": "json_schema", "name": "city", "schema": WEATHER, "strict": True}})
    jsonschema.validate(json.loads(out.output_text), WEATHER)


def test_retrieve_delete_and_another_keys_view(client: openai.OpenAI, base_url: str) -> None:
    out = client.responses.create(model=MODEL, input="Hello", **GREEDY)
    assert client.responses.retrieve(out.id).output_text == out.output_text
    with openai.OpenAI(base_url=base_url, api_key=KEY_BETA, max_retries=0, timeout=60) as other:
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(out.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.create(model=MODEL, input="Hi", previous_response_id=out.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(out.id)
    client.responses.delete(out.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(out.id)
    unstored = client.responses.create(model=MODEL, input="Hello", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("fields", [
    {"input": [{"type": "input_image", "image_url": "http://x/y.png"}]},
    {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
    {"input": "hi", "tools": [{"type": "web_search"}]},
    {"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS},
    {"input": "hi", "unknown_field": 1},
    {"input": "hi", "max_output_tokens": 0},
    {"input": [{"type": "function_call_output", "output": "no call id"}]},
])
def test_bad_input_is_a_400_in_openai_shape(client: openai.OpenAI, fields: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/responses", body={"model": MODEL, **fields}, cast_to=object)
    error = info.value.body
    assert isinstance(error, dict) and error["type"] == "invalid_request_error" and error["message"]


def test_openai_agents_sdk_loop_with_a_function_tool(base_url: str) -> None:
    """The Agents SDK's own loop on /v1/responses: a forced call to the function tool (the
    SDK runs it), then, tool_choice reset to auto, the final answer in the agent's output
    type (text.format json_schema)."""
    agents = pytest.importorskip("agents")
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Oslo", "Paris"]) -> str:
        """Weather in a city."""
        calls.append(city)
        return "Sunny, 21 C"

    client = openai.AsyncOpenAI(base_url=base_url, api_key=KEY_ALPHA, max_retries=0, timeout=300)
    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=80)
    agent = agents.Agent(name="weather", instructions="Answer briefly.", tools=[get_weather], model=model,
                         model_settings=settings, output_type=Answer)
    agents.set_tracing_disabled(True)
    result = agents.Runner.run_sync(agent, "Weather in Oslo?", max_turns=4)
    assert calls and calls[0] in ("Oslo", "Paris") and isinstance(result.final_output, Answer)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
