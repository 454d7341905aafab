"""The <think> reasoning parser: whole and streamed (in every split) agree; what the chat
formatter makes of it, streamed and whole, with and without tool calls."""
from __future__ import annotations

import random

import pytest

from router.frontend.openai_api import convert
from router.frontend.reasoning.choose import parser_name, reasoning_factory
from router.frontend.reasoning.think import ThinkParser
from router.frontend.tool_calling.chat_tools import ToolMode
from worker.api import RequestOutput

CASES = [
    # (starts_inside, output, reasoning, content)
    (False, "<think>\nLet me see.\n</think>\n\nOslo is sunny.", "\nLet me see.\n", "\n\nOslo is sunny."),
    (False, "  <think>a<b</think>c", "a<b", "c"),
    (False, "Plain answer, no thinking.", "", "Plain answer, no thinking."),
    (False, "<thin", "", "<thin"),  # ended before it could be a tag: content
    (False, "<think>cut by max_tokens", "cut by max_tokens", ""),
    (False, "", "", ""),
    (True, "reasoning first</think>answer</think>", "reasoning first", "answer</think>"),
    (True, "never closed </thin", "never closed </thin", ""),
]


@pytest.mark.parametrize("starts_inside,text,reasoning,content", CASES)
def test_whole_and_streamed_agree(starts_inside: bool, text: str, reasoning: str, content: str) -> None:
    assert ThinkParser(starts_inside).parse(text) == (reasoning, content)
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        parser = ThinkParser(starts_inside)
        parts = [parser.feed(piece) for piece in pieces] + [parser.finish()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (reasoning, content), pieces


def test_auto_reads_the_template_and_the_prompt() -> None:
    assert parser_name("auto", "{{ '<think>' }}") == "think"
    assert parser_name("auto", "{{ messages }}") == "none" and parser_name("auto", None) == "none"
    assert parser_name("none", "<think>") == "none" and parser_name("think", None) == "think"
    with pytest.raises(ValueError):
        parser_name("harmonyx", None)

    class Tokenizer:
        chat_template = "... <think> ..."

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "".join(chr(i) for i in ids)

    inside = reasoning_factory("auto", Tokenizer(), [ord(c) for c in "<|assistant|>\n<think>\n"])
    outside = reasoning_factory("auto", Tokenizer(), [ord(c) for c in "<|assistant|>\n"])
    assert inside is not None and inside().parse("x</think>y") == ("x", "y")
    assert outside is not None and outside().parse("x</think>y") == ("", "x</think>y")


def outputs(text: str, pieces: int) -> list[RequestOutput]:
    size = max(1, len(text) // pieces)
    chunks = [text[i:i + size] for i in range(0, len(text), size)]
    return [RequestOutput("r", [0], chunk, i == len(chunks) - 1, "stop" if i == len(chunks) - 1 else None)
            for i, chunk in enumerate(chunks)]


def formatter(tools: bool) -> convert.ChatFormatter:
    class Texts:
        def __call__(self, token_id: int) -> str:
            return str(token_id)

    return convert.ChatFormatter("id", "m", Texts(), False, ToolMode("auto", "hermes") if tools else None,  # type: ignore[arg-type]
                                 reasoning=lambda: ThinkParser(False))


@pytest.mark.parametrize("tools", [False, True])
def test_chat_formatter_streams_and_answers_reasoning_apart(tools: bool) -> None:
    text = ('<think>The user wants weather.</think>Checking.<tool_call>\n{"name": "w", "arguments": {"c": 1}}\n</tool_call>'
            if tools else "<think>Hmm, hello.</think>Hello there!")
    stream = formatter(tools)
    chunks = [c for c in (stream.delta_chunk(0, out) for out in outputs(text, 7)) if c is not None]
    reasoning = "".join(c.choices[0].delta.reasoning_content or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    state = convert.ChoiceState(0, 0)
    for out in outputs(text, 1):
        state.add(out)
    usage = convert.usage_of([state], [1])
    message = formatter(tools).response([state], usage).choices[0].message
    assert reasoning == message.reasoning_content == ("The user wants weather." if tools else "Hmm, hello.")
    assert content == message.content == ("Checking." if tools else "Hello there!")
    if tools:
        assert message.tool_calls is not None and message.tool_calls[0].function.name == "w"
        assert any(c.choices[0].delta.tool_calls for c in chunks)


# -- gpt-oss harmony (router/frontend/reasoning/harmony.py + the harmony tool-call parser) ----
HARMONY_CALL = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>')
HARMONY_ANSWER = ('<|channel|>analysis<|message|>Think <|briefly|>.<|end|><|start|>assistant<|channel|>final'
                  '<|message|>Hello <b>there</b>!<|return|>')


def test_harmony_whole_and_streamed_agree() -> None:
    from router.frontend.reasoning.harmony import HarmonyParser

    for text, expected in ((HARMONY_ANSWER, ("Think <|briefly|>.", "Hello <b>there</b>!")),
                           (HARMONY_CALL, ("Need the weather.", '<|start|>to=functions.get_weather<|message|>{"city": "Oslo"}<|call|>')),
                           ("<|channel|>final<|message|>cut sho", ("", "cut sho")),
                           ("<|channel|>analysis<|message|>cut while thin", ("cut while thin", ""))):
        assert HarmonyParser().parse(text) == expected
        for size in (1, 2, 5, 11):
            parser = HarmonyParser()
            parts = [parser.feed(text[i:i + size]) for i in range(0, len(text), size)] + [parser.finish()]
            assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == expected, size


def test_harmony_reasoning_then_tool_calls_through_the_formatter() -> None:
    from router.frontend.reasoning.harmony import HarmonyParser

    class Texts:
        def __call__(self, token_id: int) -> str:
            return str(token_id)

    def fresh() -> convert.ChatFormatter:
        return convert.ChatFormatter("id", "m", Texts(), False, ToolMode("auto", "harmony"), reasoning=HarmonyParser)  # type: ignore[arg-type]

    stream = fresh()
    chunks = [c for c in (stream.delta_chunk(0, out) for out in outputs(HARMONY_CALL, 9)) if c is not None]
    assert "".join(c.choices[0].delta.reasoning_content or "" for c in chunks) == "Need the weather."
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or ()]
    assert calls[0].function.name == "get_weather" and chunks[-1].choices[0].finish_reason == "tool_calls"
    state = convert.ChoiceState(0, 0)
    for out in outputs(HARMONY_CALL, 1):
        state.add(out)
    message = fresh().response([state], convert.usage_of([state], [1])).choices[0].message
    assert message.reasoning_content == "Need the weather." and not message.content
    assert message.tool_calls is not None and message.tool_calls[0].function.arguments == '{"city": "Oslo"}'


def test_harmony_is_chosen_from_the_template() -> None:
    from router.frontend.reasoning.choose import keeps_special_tokens
    from router.frontend.tool_calling.registry import parser_for_template

    template = "{{ '<|start|>assistant<|channel|>final<|message|>' }}"
    assert parser_name("auto", template) == "harmony" and parser_for_template(template) == "harmony"
    assert keeps_special_tokens("auto", template) and not keeps_special_tokens("auto", "<think>")
