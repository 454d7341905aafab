"""OpenAI bodies <-> engine requests and outputs.

In: a validated request becomes one `EngineInput` per choice (token ids, tokenized once
here, and SamplingParams). Out: the engine's `RequestOutput`s, merged over choices,
become a response body or stream chunks. Nothing here does I/O.

Choice indices: completions with several prompts number their choices
prompt_index * n + i, as OpenAI does; chat has one prompt, so index = i.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.frontend.openai_api import protocol as p
from router.frontend.tool_calling import chat_tools
from router.frontend.reasoning.budget import thinking_budget
from router.frontend.reasoning.choose import keeps_special_tokens as reasoning_keeps_special_tokens
from router.errors import bad_request
from router.frontend.openai_api.structured import structured_output_of
from worker.api import SamplingParams, SamplingParamsError, StructuredOutput, ThinkingBudget


@dataclass(frozen=True)
class EngineInput:
    index: int  # the choice's index in the response
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams


# -- requests -> engine inputs -----------------------------------------------------------
def encode_completion_prompts(tokenizer: Any, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    """Each prompt as token ids; text gets the tokenizer's special tokens (BOS) added."""
    if isinstance(prompt, str):
        return [tokenizer(prompt).input_ids]
    if all(isinstance(x, int) for x in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if all(isinstance(x, str) for x in prompt):
        return [ids for ids in tokenizer(list(prompt)).input_ids]
    return [list(ids) for ids in prompt]  # type: ignore[union-attr]


def encode_chat(tokenizer: Any, request: p.ChatCompletionRequest) -> list[int]:
    """The chat template renders the conversation (BOS included); then tokenize it as is."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad_request("This model has no chat template; use /v1/completions.", "messages")
    messages = [chat_tools.template_message(m) for m in request.messages]
    tool_defs = chat_tools.tools_for_template(request)
    try:
        text = tokenizer.apply_chat_template(
            messages,
            **({"tools": tool_defs} if tool_defs else {}),
            tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            # reasoning_effort reaches the templates that take it (gpt-oss's); the client's
            # own chat_template_kwargs win.
            **(({"reasoning_effort": request.reasoning_effort} if request.reasoning_effort else {})
               | (request.chat_template_kwargs or {})),
        )
    except Exception as e:  # jinja's TemplateError (raise_exception in the template) and kin
        raise bad_request(f"The chat template rejected the messages: {e}", "messages") from None
    return tokenizer(text, add_special_tokens=False).input_ids


def check_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    if num_prompt_tokens == 0:
        raise bad_request("The prompt is empty.", "prompt")
    requested = num_prompt_tokens + (max_tokens or 1)
    if requested > max_model_len:
        # Blame the prompt when it alone leaves no room for one output token.
        param = "prompt" if num_prompt_tokens >= max_model_len or not max_tokens else "max_tokens"
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{requested} tokens ({num_prompt_tokens} in the prompt, {max_tokens or 1} in the completion). "
            f"Please reduce the length of the prompt or the completion.",
            param,
            "context_length_exceeded",
        )


def sampling_params(
    request: p.CompletionRequest | p.ChatCompletionRequest,
    max_tokens: int,
    logprobs: int | None,
    choice: int,
    structured: StructuredOutput | None = None,
    prompt_logprobs: int | None = None,
    thinking: ThinkingBudget | None = None,
) -> SamplingParams:
    """Choice i of a seeded request uses seed + i: reproducible, yet the n choices differ."""
    top_k = request.top_k if request.top_k is not None and request.top_k > 0 else 0
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=top_k,
            min_p=request.min_p or 0.0,
            seed=None if request.seed is None else (request.seed + choice) % 2**63,
            repetition_penalty=request.repetition_penalty or 1.0,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            stop=tuple(request.stop_list),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
            include_stop_str_in_output=request.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            min_tokens=min(request.min_tokens, max_tokens),
            skip_special_tokens=request.skip_special_tokens,
            structured=structured,
            logit_bias=request.logit_bias_pairs,
            cache_salt=request.cache_salt,
            thinking=thinking,
        )
    except SamplingParamsError as e:
        raise bad_request(str(e)) from None


def check_token_ids(request: p.CompletionRequest | p.ChatCompletionRequest, tokenizer: Any) -> None:
    """logit_bias and stop_token_ids name tokens of this model's vocabulary (400 otherwise)."""
    if not request.logit_bias and not request.stop_token_ids:
        return
    vocab = len(tokenizer)
    for token_id, _ in request.logit_bias_pairs:
        if token_id >= vocab:
            raise bad_request(f"logit_bias has token id {token_id}, outside the vocabulary (0..{vocab - 1}).", "logit_bias")
    for token_id in request.stop_token_ids or ():
        if token_id >= vocab:
            raise bad_request(f"stop_token_ids has token id {token_id}, outside the vocabulary (0..{vocab - 1}).", "stop_token_ids")


def check_n(n: int, max_n: int) -> None:
    if n > max_n:
        raise bad_request(f"n must be at most {max_n} on this server, got {n}.", "n", "invalid_value")


def completion_inputs(
    request: p.CompletionRequest, tokenizer: Any, max_model_len: int, max_n: int
) -> list[EngineInput]:
    check_n(request.n, max_n)
    structured = structured_output_of(request)
    check_token_ids(request, tokenizer)
    inputs = []
    for prompt_index, ids in enumerate(encode_completion_prompts(tokenizer, request.prompt)):
        check_length(len(ids), request.max_tokens, max_model_len)
        max_tokens = request.max_tokens or max_model_len - len(ids)
        for i in range(request.n):
            params = sampling_params(request, max_tokens, request.logprobs, i, structured, request.engine_prompt_logprobs)
            inputs.append(EngineInput(prompt_index * request.n + i, prompt_index, ids, params))
    return inputs


def chat_inputs(
    request: p.ChatCompletionRequest, tokenizer: Any, max_model_len: int, max_n: int, tool_parser: str = "auto",
    reasoning_parser: str = "none",
) -> list[EngineInput]:
    check_n(request.n, max_n)
    template = getattr(tokenizer, "chat_template", None)
    mode = chat_tools.tool_mode(request, tool_parser, template)
    structured = chat_tools.chat_structured_output(request, mode)
    # The calls' or channels' markers are special tokens: the output keeps them.
    if (mode is not None and mode.keeps_special_tokens) or (
            structured is None and reasoning_keeps_special_tokens(reasoning_parser, template)):
        request = request.model_copy(update={"skip_special_tokens": False})
    check_token_ids(request, tokenizer)
    ids = encode_chat(tokenizer, request)
    requested = request.max_output_tokens
    check_length(len(ids), requested, max_model_len)
    # No max_tokens in chat means "as long as the context allows", as with OpenAI.
    max_tokens = requested or max_model_len - len(ids)
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    # A grammar decides every token of its output: there is no thinking section to bound.
    thinking = None if structured is not None else thinking_budget(request.thinking_token_budget, reasoning_parser,
                                                                   tokenizer, ids)
    return [
        EngineInput(i, 0, ids, sampling_params(request, max_tokens, logprobs, i, structured, request.prompt_logprobs,
                                               thinking))
        for i in range(request.n)
    ]


# The outgoing half (router/frontend/openai_api/formatting.py), re-exported for `convert.` users.
from router.frontend.openai_api.logprobs import TokenTexts, chat_logprobs, completion_logprobs  # noqa: E402,F401
from router.frontend.openai_api.formatting import (  # noqa: E402,F401
    ChoiceState,
    usage_of,
    CompletionFormatter,
    ChatFormatter,
    sse,
    SSE_DONE,
)
