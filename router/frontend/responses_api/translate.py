"""A Responses request as the chat-completions request it is, and the chat answer back
as a Responses body. The chat path does the work (template, tokens, sampling, tool
calls, structured outputs); this file only renames.

    Responses                       chat completions
    instructions                    a leading system message (not carried over by
                                    previous_response_id, as the spec says)
    previous_response_id            the stored conversation, before `input`
    max_output_tokens               max_completion_tokens
    tools [{type, name, ...}]       tools [{type, function: {name, ...}}]
    tool_choice {type, name}        tool_choice {type, function: {name}}
    text.format json_schema         response_format json_schema (not on a turn whose
                                    tool_choice forces a call: the call is its output)
    reasoning.effort                reasoning_effort
"""
from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from router import errors
from router.frontend.openai_api import protocol as p
from router.frontend.responses_api.items import chat_messages
from router.frontend.responses_api.protocol import NamedFunction, ResponsesRequest


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]], stream: bool) -> p.ChatCompletionRequest:
    """The chat request of this turn: instructions, the stored conversation, the input."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    messages += chat_messages(req.input)
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "stream": stream,
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "top_k": req.top_k, "seed": req.seed, "parallel_tool_calls": req.parallel_tool_calls,
        "logprobs": req.top_logprobs is not None, "top_logprobs": req.top_logprobs,
    }
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})} for t in req.tools]
    if isinstance(req.tool_choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    if req.tool_choice == "required" or isinstance(req.tool_choice, NamedFunction):
        fmt = None  # a forced call is the whole output: text.format governs text answers only
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise errors.bad_request("Missing required parameter: 'text.format.schema'.", "text.format.schema", "missing_required_parameter")
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    return errors.validated(p.ChatCompletionRequest, body)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(message: p.ChatResponseMessage) -> list[dict[str, Any]]:
    """The chat answer as Responses output items: its reasoning, its text, then each tool call."""
    items: list[dict[str, Any]] = []
    if message.reasoning_content:
        items.append(reasoning_item(new_id("rs"), message.reasoning_content, "completed"))
    if message.content or not message.tool_calls:
        items.append(message_item(new_id("msg"), message.content or "", "completed"))
    for call in message.tool_calls or ():
        items.append(call_item(new_id("fc"), call.id, call.function.name, call.function.arguments, "completed"))
    return items


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [text_part(text)] if text is not None else []
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text is not None else []
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [], "content": content}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name, "arguments": arguments}


def usage_body(usage: p.Usage) -> dict[str, Any]:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not None else 0
    return {
        "input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def response_body(
    response_id: str, req: ResponsesRequest, model: str, created_at: int, count_tokens: Callable[[str], int] | None,
    status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None, finish_reason: str | None = None,
) -> dict[str, Any]:
    """The Response object; `status` in_progress while streaming, then completed, or
    incomplete when max_output_tokens (or the context) cut the answer. Reasoning tokens are
    the reasoning items' text tokenized again (`count_tokens`)."""
    if status != "in_progress":
        status = "incomplete" if finish_reason == "length" else "completed"
    if usage is not None and count_tokens is not None:
        texts = [part["text"] for item in output if item["type"] == "reasoning" for part in item["content"]]
        usage["output_tokens_details"]["reasoning_tokens"] = sum(count_tokens(text) for text in texts)
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else {"type": "text"}
    tool_choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction) else (req.tool_choice or "auto")
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt}, "tool_choice": tool_choice,
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
        "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
        "usage": usage, "user": req.user, "metadata": req.metadata or {},
    }
