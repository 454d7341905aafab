"""A request's thinking budget (Anthropic's `thinking.budget_tokens`, chat's
`thinking_token_budget`) as the engine's ThinkingBudget: the `<think>` / `</think>` tags
in the model's own token ids, and whether the rendered prompt already opened the section
(as router/frontend/reasoning/choose.py's think parser is told). The engine enforces it
(worker/sampling/thinking.py). Only `<think>` models take a budget: a harmony model or
one without a reasoning section is refused, never served unbounded.
"""
from __future__ import annotations

from typing import Any

from router.errors import bad_request
from router.frontend.reasoning.choose import parser_name, prompt_opens_thinking
from router.frontend.reasoning.think import CLOSE, OPEN
from worker.api import MAX_THINKING_MARKER_IDS, ThinkingBudget


def thinking_budget(budget: int | None, setting: str, tokenizer: Any, prompt_token_ids: list[int],
                    param: str = "thinking_token_budget") -> ThinkingBudget | None:
    """The engine's budget for a request that asked for `budget` thinking tokens (None: none)."""
    if budget is None:
        return None
    if parser_name(setting, getattr(tokenizer, "chat_template", None)) != "think":
        raise bad_request("a thinking budget needs a model that thinks in <think> ... </think> (its reasoning "
                          "parser 'think'); this model's is not.", param)
    start = tuple(tokenizer.encode(OPEN, add_special_tokens=False))
    end = tuple(tokenizer.encode(CLOSE, add_special_tokens=False))
    if not 0 < len(end) <= MAX_THINKING_MARKER_IDS or not 0 < len(start) <= MAX_THINKING_MARKER_IDS:
        raise bad_request("this model's tokenizer does not encode the <think> tags in a few tokens.", param)
    return ThinkingBudget(budget, start, end, starts_inside=prompt_opens_thinking(tokenizer, prompt_token_ids))
