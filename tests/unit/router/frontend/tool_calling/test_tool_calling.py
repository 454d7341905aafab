"""Tool-call parsers (whole and streamed), tool_choice -> constraint, the request fields
-> StructuredOutput, and the chat formatter's tool_calls (non-streamed and deltas)."""
from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from router.frontend.openai_api import protocol as p
from router.frontend.tool_calling import chat_tools
from router.errors import APIError
from router.frontend.openai_api.convert import ChatFormatter, ChoiceState, TokenTexts
from router.frontend.openai_api.structured import structured_output_of
from router.frontend.tool_calling.parsers import HermesParser, JsonArrayParser, Llama3JsonParser, NamedParser, parser_for_template
from worker.api import RequestOutput, StructuredOutput

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def chat(**extra: object) -> p.ChatCompletionRequest:
    return p.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}], **extra})


HERMES_TEXT = (
    'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def test_hermes_parse_whole() -> None:
    content, calls = HermesParser().parse(HERMES_TEXT)
    assert content == "Let me look. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_hermes_streamed_in_pieces_matches_whole(step: int) -> None:
    parser = HermesParser()
    content, names = "", []
    for i in range(0, len(HERMES_TEXT), step):
        c, calls = parser.feed(HERMES_TEXT[i : i + step])
        assert "<tool" not in c  # a marker is never leaked as content
        content += c
        names += [x.name for x in calls]
    c, calls = parser.finish()
    assert content + c == "Let me look. " and names + [x.name for x in calls] == ["get_weather", "get_time"]


def test_hermes_plain_text_and_unclosed_and_broken() -> None:
    assert HermesParser().parse("just text <tool") == ("just text <tool", [])
    content, calls = HermesParser().parse('<tool_call>{"name": "f", "arguments": {"a": 1}}')  # EOS before the close
    assert content == "" and calls[0].name == "f"
    content, calls = HermesParser().parse("<tool_call>not json</tool_call>")
    assert calls == [] and content == "<tool_call>not json</tool_call>"


def test_llama3_json() -> None:
    content, calls = Llama3JsonParser().parse('{"name": "get_weather", "parameters": {"city": "a;b"}}; {"name": "get_time", "parameters": {}}')
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "a;b"}
    assert Llama3JsonParser().parse('<|python_tag|>{"name": "f", "parameters": {}}')[1][0].name == "f"
    assert Llama3JsonParser().parse("Hello {not a call}") == ("Hello {not a call}", [])
    assert Llama3JsonParser().parse("{broken") == ("{broken", [])


def test_parser_for_template() -> None:
    assert parser_for_template("... <tool_call> ...") == "hermes"
    assert parser_for_template("{{ '<|python_tag|>' }} ipython") == "llama3_json"
    assert parser_for_template(None) == "hermes"


def test_required_constraint_forces_parseable_calls() -> None:
    req = chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    mode = chat_tools.tool_mode(req, "auto", "<tool_call>")
    so = chat_tools.tool_constraint(req, mode)
    assert so is not None and so.kind == "json_schema"
    schema = json.loads(so.spec)
    assert schema["maxItems"] == 1
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "x"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], schema)
    calls = JsonArrayParser().parse('[{"name": "get_weather", "parameters": {"city": "x"}}]')[1]
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "x"}


def test_named_and_none_and_auto() -> None:
    named = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    mode = chat_tools.tool_mode(named, "hermes", None)
    assert mode is not None and mode.choice == "named" and mode.finish_reason == "stop"
    assert json.loads(chat_tools.tool_constraint(named, mode).spec) == WEATHER["function"]["parameters"]  # type: ignore[union-attr]
    assert NamedParser("get_weather").parse('{"city": "Rome"}')[1][0].name == "get_weather"
    none = chat(tools=[WEATHER], tool_choice="none")
    assert chat_tools.tool_mode(none, "hermes", None) is None and chat_tools.tools_for_template(none) is None
    auto = chat(tools=[WEATHER])
    mode = chat_tools.tool_mode(auto, "auto", "x")
    assert mode is not None and mode.choice == "auto" and chat_tools.tool_constraint(auto, mode) is None


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
        {"tool_choice": "required"},
        {"tool_choice": "sometimes", "tools": [WEATHER]},
    ],
)
def test_bad_tool_choice_is_refused(extra: dict) -> None:
    with pytest.raises(Exception):
        chat(**extra)


def test_request_fields_to_structured_output() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
         StructuredOutput("json_schema", json.dumps(schema))),
        ({"guided_json": schema}, StructuredOutput("json_schema", json.dumps(schema))),
        ({"guided_regex": "[a-z]+"}, StructuredOutput("regex", "[a-z]+")),
        ({"guided_choice": ["a", "b"]}, StructuredOutput("choice", '["a", "b"]')),
        ({"guided_grammar": 'start: "x"'}, StructuredOutput("grammar", 'start: "x"')),
        ({"structured_outputs": {"regex": "\\d+"}}, StructuredOutput("regex", "\\d+")),
        ({"response_format": {"type": "text"}}, None),
        ({}, None),
    ]
    for extra, expected in cases:
        assert structured_output_of(chat(**extra)) == expected, extra


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
        {"guided_json": "{oops"},
        {"guided_regex": "("},
        {"guided_regex": "a", "guided_choice": ["a"]},
        {"response_format": {"type": "yaml"}},
    ],
)
def test_invalid_constraints_are_400(extra: dict) -> None:
    with pytest.raises(APIError) as info:
        structured_output_of(chat(**extra))
    assert info.value.status == 400


def _out(text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", [1], text_delta=text, finished=finished, finish_reason="stop" if finished else None)


def test_formatter_tool_calls_whole_and_streamed() -> None:
    req = chat(tools=[WEATHER, TIME])
    mode = chat_tools.tool_mode(req, "hermes", None)
    texts = TokenTexts(None)
    whole = ChatFormatter("id", "m", texts, False, mode)
    state = ChoiceState(0, 0, text_parts=[HERMES_TEXT], finish_reason="stop")
    response = whole.response([state], p.Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2))
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look. "
    assert [c.function.name for c in choice.message.tool_calls or []] == ["get_weather", "get_time"]

    streamed = ChatFormatter("id", "m", texts, False, mode)
    pieces = [HERMES_TEXT[i : i + 5] for i in range(0, len(HERMES_TEXT), 5)]
    chunks = [streamed.delta_chunk(0, _out(t)) for t in pieces] + [streamed.delta_chunk(0, _out("", True))]
    deltas = [c.choices[0] for c in chunks if c is not None]
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo"}
    assert deltas[-1].finish_reason == "tool_calls"
    assert "".join(d.delta.content or "" for d in deltas) == "Let me look. "


# -- the DeepSeek-V3 and Mistral families (router/frontend/tool_calling/families.py) ---------
FAMILY_CASES = [
    ("deepseek_v3",
     "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
     "{\"city\": \"Oslo\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "Let me check.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("deepseek_v3",
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Oslo\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "", [("get_weather", {"city": "Oslo"})]),
    ("deepseek_v3", "No tools <｜tool▁ here.", "No tools <｜tool▁ here.", []),
    ("mistral", "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}]</s>", "",
     [("get_weather", {"city": "Oslo"})]),
    ("mistral", "Sure.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Oslo\"}[TOOL_CALLS]get_time[ARGS]{}</s>", "Sure.",
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("mistral", "Plain answer.</s>", "Plain answer.", []),
    ("mistral", "[TOOL_CALLS]not json", "[TOOL_CALLS]not json", []),
]


@pytest.mark.parametrize("name,text,content,calls", FAMILY_CASES)
def test_family_parsers_whole_and_streamed(name: str, text: str, content: str, calls: list[tuple[str, dict[str, Any]]]) -> None:
    from router.frontend.tool_calling.registry import PARSERS

    got_content, got_calls = PARSERS[name]().parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    for size in (1, 3, 7):
        parser = PARSERS[name]()
        streamed, deltas = "", []
        for i in range(0, len(text), size):
            more, new = parser.stream(text[i:i + size])
            streamed, deltas = streamed + more, deltas + new
        more, new = parser.stream_end()
        streamed, deltas = streamed + more, deltas + new
        assert streamed == content
        assert [(d.name, json.loads(a.arguments)) for d, a in zip(deltas[::2], deltas[1::2])] == calls
    if name == "mistral":  # its templates want 9-character alphanumeric ids
        assert all(len(c.id) == 9 and c.id.isalnum() for c in got_calls)


def test_family_parsers_from_the_template() -> None:
    from router.frontend.tool_calling.registry import parser_for_template

    assert parser_for_template("{{ '<｜tool▁calls▁begin｜>' }}") == "deepseek_v3"
    assert parser_for_template("{{ '[TOOL_CALLS]' + tool_calls | tojson }}") == "mistral"
    assert parser_for_template("... <tool_call> ...") == "hermes"
    from router.frontend.tool_calling.chat_tools import ToolMode

    assert ToolMode("auto", "mistral").keeps_special_tokens and not ToolMode("required", "mistral").keeps_special_tokens
    assert not ToolMode("auto", "hermes").keeps_special_tokens
