"""A chat request's thinking_token_budget as the engine's ThinkingBudget
(router/frontend/reasoning/budget.py): the <think> tags in the model's token ids, the
section opened by the template or not; refused (400) for a model without a <think>
section; none under a grammar (its output has no thinking section)."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from router import errors
from router.frontend.openai_api import convert
from router.frontend.openai_api import protocol as p

QUESTION = [{"role": "user", "content": "Why?"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from tests.support.tiny_served_model import make_served_model

    path = make_served_model(tmp_path_factory.mktemp("tok") / "m")
    return AutoTokenizer.from_pretrained(Path(path))


def thinking_tokenizer(tokenizer: Any, opens: bool) -> Any:
    think = copy.deepcopy(tokenizer)
    think.chat_template = tokenizer.chat_template.replace("'<|assistant|>\\n'", "'<|assistant|>\\n<think>\\n'" if opens
                                                          else "'<|assistant|>\\n'") + "{# <think> #}"
    return think


def chat(**fields: Any) -> p.ChatCompletionRequest:
    return p.ChatCompletionRequest.model_validate({"model": "m", "messages": QUESTION, **fields})


@pytest.mark.parametrize("opens", [True, False])
def test_budget_reaches_the_engine_in_token_ids(tokenizer: Any, opens: bool) -> None:
    think = thinking_tokenizer(tokenizer, opens)
    [inp] = convert.chat_inputs(chat(thinking_token_budget=7), think, 200, 4, reasoning_parser="auto")
    budget = inp.params.thinking
    assert budget is not None and budget.max_tokens == 7 and budget.starts_inside is opens
    assert think.decode(list(budget.start_token_ids)) == "<think>"
    assert think.decode(list(budget.end_token_ids)) == "</think>"
    assert convert.chat_inputs(chat(), think, 200, 4, reasoning_parser="auto")[0].params.thinking is None
    grammar = chat(thinking_token_budget=7, response_format={"type": "json_object"})
    assert convert.chat_inputs(grammar, think, 200, 4, reasoning_parser="auto")[0].params.thinking is None


def test_budget_without_a_think_section_is_400(tokenizer: Any) -> None:
    with pytest.raises(errors.APIError) as info:
        convert.chat_inputs(chat(thinking_token_budget=7), tokenizer, 200, 4, reasoning_parser="auto")
    assert info.value.status == 400 and info.value.param == "thinking_token_budget"
