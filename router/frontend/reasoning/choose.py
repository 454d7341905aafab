"""Which reasoning parser serves a model (IngressSettings.reasoning_parser): `think`,
`harmony` (gpt-oss), `none`, or `auto`, which reads the chat template (harmony's
`<|channel|>`, else `<think>`), as the tool-call parser's `auto` does. Per request, the
think parser is told whether the rendered prompt already opened the thinking block."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from router.frontend.reasoning.harmony import CHANNEL, HarmonyParser
from router.frontend.reasoning.think import OPEN, ThinkParser

REASONING_PARSERS = ("auto", "none", "think", "harmony")


class ReasoningParser(Protocol):
    def feed(self, delta: str) -> tuple[str, str]: ...

    def finish(self) -> tuple[str, str]: ...

    def parse(self, text: str) -> tuple[str, str]: ...


ReasoningFactory = Callable[[], ReasoningParser]


def parser_name(setting: str, chat_template: str | None) -> str:
    if setting not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {setting!r}; known: {', '.join(REASONING_PARSERS)}")
    if setting != "auto":
        return setting
    if chat_template is not None and CHANNEL in chat_template:
        return "harmony"
    return "think" if chat_template is not None and OPEN in chat_template else "none"


def keeps_special_tokens(setting: str, chat_template: str | None) -> bool:
    """Harmony's channels are special tokens: its output is decoded with them kept."""
    return parser_name(setting, chat_template) == "harmony"


def reasoning_factory(setting: str, tokenizer: Any, prompt_token_ids: list[int]) -> ReasoningFactory | None:
    """A new parser per choice, or None when the model's output has no reasoning part."""
    name = parser_name(setting, getattr(tokenizer, "chat_template", None))
    if name == "none":
        return None
    if name == "harmony":
        return HarmonyParser
    starts_inside = prompt_opens_thinking(tokenizer, prompt_token_ids)
    return lambda: ThinkParser(starts_inside)


def prompt_opens_thinking(tokenizer: Any, prompt_token_ids: list[int]) -> bool:
    """Whether the rendered prompt ends with the open tag (the output starts inside the
    section): its last few tokens are enough to see."""
    tail = tokenizer.decode(prompt_token_ids[-8:], skip_special_tokens=False)
    return tail.rstrip().endswith(OPEN)
