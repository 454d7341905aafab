"""Which reasoning parser serves a model (IngressSettings.reasoning_parser): `think`, `none`,
or `auto`, which reads the chat template (a template that speaks of `<think>` gets the
`think` parser), as the tool-call parser's `auto` does. Per request, the parser is told
whether the rendered prompt already opened the thinking block."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from router.frontend.reasoning.think import OPEN, ThinkParser

REASONING_PARSERS = ("auto", "none", "think")

ReasoningFactory = Callable[[], ThinkParser]


def parser_name(setting: str, chat_template: str | None) -> str:
    if setting not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {setting!r}; known: {', '.join(REASONING_PARSERS)}")
    if setting != "auto":
        return setting
    return "think" if chat_template is not None and OPEN in chat_template else "none"


def reasoning_factory(setting: str, tokenizer: Any, prompt_token_ids: list[int]) -> ReasoningFactory | None:
    """A new parser per choice, or None when the model's output has no reasoning part."""
    if parser_name(setting, getattr(tokenizer, "chat_template", None)) == "none":
        return None
    # The prompt's last few tokens are enough to see whether it ends with the open tag.
    tail = tokenizer.decode(prompt_token_ids[-8:], skip_special_tokens=False)
    starts_inside = tail.rstrip().endswith(OPEN)
    return lambda: ThinkParser(starts_inside)
