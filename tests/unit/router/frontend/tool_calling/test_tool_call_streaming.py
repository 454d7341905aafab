"""Tool-call arguments stream in fragments (Hermes and Llama 3 JSON formats), as OpenAI
streams them: the first delta of a call carries id, type and name, later ones argument
text only, never the format's wrapper. The official `openai` client's own stream
accumulator (the one `client.chat.completions.stream` uses) rebuilds the message from our
SSE chunks; its calls parse to the same JSON as the non-streamed response's."""
from __future__ import annotations

import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from router.frontend.openai_api import protocol as p
from router.frontend.tool_calling import chat_tools
from router.frontend.openai_api.convert import ChatFormatter, ChoiceState, TokenTexts, sse
from router.frontend.tool_calling.parsers import HermesParser, Llama3JsonParser
from worker.api import RequestOutput

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

HERMES = (
    'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo {north}", "days": 3, '
    '"nested": {"a": [1, 2, {"b": "}\\""}]}}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)
LLAMA3 = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo; north", "days": 3}}; '
    '{"name": "get_time", "parameters": {}}'
)


REQUIRED = (
    '[{"name": "get_weather", "parameters": {"city": "Oslo, [north]", "days": 3}}, '
    '{"name": "get_time", "parameters": {}}]'
)


def _chat(parser: str) -> tuple[ChatFormatter, chat_tools.ToolMode]:
    """`parser` "required": a forced `required` choice (a JSON array of calls)."""
    choice = {"tool_choice": "required"} if parser == "required" else {}
    request = p.ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER, TIME], **choice}
    )
    mode = chat_tools.tool_mode(request, "hermes" if parser == "required" else parser, None)
    assert mode is not None
    return ChatFormatter("id", "m", TokenTexts(None), False, mode), mode


def _out(text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", [1], text_delta=text, finished=finished, finish_reason="stop" if finished else None)


def _stream(text: str, parser: str, step: int) -> tuple[list[dict], ChatCompletionStreamState]:
    """Feed the text in `step`-character pieces; return the wire chunks (as dicts) and the
    openai client's accumulated state."""
    formatter, _ = _chat(parser)
    state = ChatCompletionStreamState(input_tools=[WEATHER, TIME])
    events = [formatter.start_chunks([0])[0]]
    events += [formatter.delta_chunk(0, _out(text[i : i + step])) for i in range(0, len(text), step)]
    events.append(formatter.delta_chunk(0, _out("", True)))
    chunks = [json.loads(sse(e).removeprefix("data: ")) for e in events if e is not None]
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return chunks, state


def _whole(text: str, parser: str) -> p.ChatResponseMessage:
    formatter, _ = _chat(parser)
    usage = p.Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)
    return formatter.response([ChoiceState(0, 0, text_parts=[text], finish_reason="stop")], usage).choices[0].message


@pytest.mark.parametrize("parser,text", [("hermes", HERMES), ("llama3_json", LLAMA3), ("required", REQUIRED)])
@pytest.mark.parametrize("step", [1, 2, 5, 13, 10_000])
def test_streamed_arguments_rebuild_the_non_streamed_calls(parser: str, text: str, step: int) -> None:
    chunks, state = _stream(text, parser, step)
    final = state.get_final_completion().choices[0]
    whole = _whole(text, parser)
    assert final.finish_reason == "tool_calls"
    streamed_calls = final.message.tool_calls or []
    assert [c.function.name for c in streamed_calls] == [c.function.name for c in whole.tool_calls or []]
    for streamed, expected in zip(streamed_calls, whole.tool_calls or []):
        assert json.loads(streamed.function.arguments) == json.loads(expected.function.arguments)
        assert streamed.id.startswith("call_") and streamed.type == "function"
    assert (final.message.content or "") == (whole.content or "")
    # Wire shape: a call's first delta names it; the rest are argument fragments only.
    seen: set[int] = set()
    fragments: dict[int, int] = {}
    for chunk in chunks:
        for tc in chunk["choices"][0]["delta"].get("tool_calls", ()):
            if tc["index"] not in seen:
                seen.add(tc["index"])
                assert tc["id"] and tc["type"] == "function" and tc["function"]["name"]
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                fragments[tc["index"]] = fragments.get(tc["index"], 0) + 1
            assert "tool_call>" not in tc["function"].get("arguments", "")
    if step <= 5:  # small pieces: the long arguments arrive in many fragments
        assert fragments[0] > 3


def test_name_goes_out_before_the_arguments_end() -> None:
    """The first delta of a call leaves as soon as its name is known."""
    parser = HermesParser()
    head = '<tool_call>{"name": "get_weather", "arguments": {"city": "Os'
    content, deltas = parser.stream(head)
    assert content == ""
    assert [(d.name, d.arguments) for d in deltas] == [("get_weather", ""), (None, '{"city": "Os')]
    content, deltas = parser.stream('lo"}}\n</tool_call> after')
    assert [d.arguments for d in deltas] == ['lo"}'] and content == " after"


def test_other_shapes_go_out_whole_and_non_calls_stay_text() -> None:
    # Arguments before the name, and arguments as a JSON string: buffered, sent whole.
    for body in ('{"arguments": {"x": 1}, "name": "f"}', '{"name": "f", "arguments": "{\\"x\\": 1}"}'):
        parser = HermesParser()
        content, deltas = parser.stream(f"<tool_call>{body}</tool_call>")
        rest, more = parser.stream_end()
        deltas += more
        assert content + rest == ""
        assert deltas[0].name == "f" and json.loads("".join(d.arguments for d in deltas)) == {"x": 1}
    # A tag whose body is no call is content, as the whole parse leaves it.
    parser = HermesParser()
    content, deltas = parser.stream("<tool_call>not json</tool_call>!")
    assert content == "<tool_call>not json</tool_call>!" and deltas == []
    # Llama 3: plain text is content at once; an unclosed call that never named is text.
    assert Llama3JsonParser().stream("Hello there")[0] == "Hello there"
    parser = Llama3JsonParser()
    assert parser.stream("{oops")[1] == []
    assert parser.stream_end() == ("{oops", [])


def test_named_choice_streams_its_arguments() -> None:
    request = p.ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    })
    mode = chat_tools.tool_mode(request, "hermes", None)
    formatter = ChatFormatter("id", "m", TokenTexts(None), False, mode)
    state = ChatCompletionStreamState(input_tools=[WEATHER, TIME])
    text = '{"city": "Oslo", "days": 2}'
    for piece in [text[i : i + 4] for i in range(0, len(text), 4)] + [""]:
        chunk = formatter.delta_chunk(0, _out(piece, finished=piece == ""))
        if chunk is not None:
            state.handle_chunk(ChatCompletionChunk.model_validate(json.loads(sse(chunk).removeprefix("data: "))))
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "stop"  # OpenAI's for a forced named call
    [call] = final.message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo", "days": 2}
