"""A Messages request as the chat-completions request it is, and the chat answer back as
an Anthropic Message. The chat path does the work; this file only renames.

    Messages                              chat completions
    system (text or text blocks)          a leading system message
    user: tool_result blocks, text        one tool message per result (in order), then the
                                          user's text, if any
    assistant: text, tool_use blocks      one assistant message: content and tool_calls
                                          (input as JSON arguments)
    thinking / redacted_thinking blocks   dropped (templates drop past thinking too)
    thinking {type}                       chat_template_kwargs enable_thinking (the answer's
                                          thinking comes back as thinking blocks whenever the
                                          reasoning parser finds some: router/frontend/reasoning/)
    thinking {budget_tokens}              thinking_token_budget (the engine ends the thinking
                                          there: router/frontend/reasoning/budget.py)
    tool_choice auto / any / tool / none  auto / required / named / none
    disable_parallel_tool_use             parallel_tool_calls false
    stop_sequences, max_tokens            stop, max_completion_tokens

    finish "length"                       stop_reason "max_tokens"
    a stop string matched                 "stop_sequence" (and which)
    tool calls made                       "tool_use"
    otherwise                             "end_turn"
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from router import errors
from router.frontend.openai_api import protocol as p
from router.frontend.messages_api.protocol import InputMessage, MessagesRequest, Conversation

_DROPPED = ("thinking", "redacted_thinking")


def chat_messages(req: Conversation) -> list[dict[str, Any]]:
    """The conversation as chat messages (plain dicts, ChatMessage's shape)."""
    out: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _texts(req.system, "system")
        out.append({"role": "system", "content": system})
    for position, message in enumerate(req.messages):
        out += _message(message, f"messages.{position}.content")
    return out


def _message(message: InputMessage, param: str) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for i, block in enumerate(message.content):
        kind, where = block.get("type"), f"{param}.{i}"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and message.role == "assistant":
            calls.append({"id": _field(block, "id", where), "type": "function", "function": {
                "name": _field(block, "name", where), "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
        elif kind == "tool_result" and message.role == "user":
            content = block.get("content")
            text = content if isinstance(content, str) else _texts(content or [], f"{where}.content")
            results.append({"role": "tool", "tool_call_id": _field(block, "tool_use_id", where), "content": text})
        elif kind in _DROPPED and message.role == "assistant":
            continue
        else:
            raise errors.bad_request(f"{where}: content blocks of type {str(kind)[:40]!r} are not supported by this server"
                                     f"{' in ' + message.role + ' messages' if kind in ('tool_use', 'tool_result') else ''}.", where)
    if message.role == "assistant":
        return [{"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})}]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _texts(blocks: list[dict[str, Any]], param: str) -> str:
    parts = []
    for i, block in enumerate(blocks):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise errors.bad_request(f"{param}.{i}: only text blocks are supported here by this server.", f"{param}.{i}")
        parts.append(block["text"])
    return "".join(parts)


def _field(block: dict[str, Any], name: str, param: str) -> str:
    value = block.get(name)
    if not isinstance(value, str):
        raise errors.bad_request(f"{param}.{name}: Field required.", f"{param}.{name}")
    return value


def chat_request(req: Conversation, stream: bool = False) -> p.ChatCompletionRequest:
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req), "stream": stream}
    if isinstance(req, MessagesRequest):
        body |= {"max_completion_tokens": req.max_tokens, "stop": req.stop_sequences,
                 "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                 "user": req.metadata.user_id if req.metadata else None}
    if req.thinking is not None:  # for the templates that switch thinking (Qwen3's enable_thinking)
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
        if req.thinking.budget_tokens is not None and isinstance(req, MessagesRequest):
            body["thinking_token_budget"] = req.thinking.budget_tokens
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                               else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    return errors.validated(p.ChatCompletionRequest, body)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def tool_input(arguments: str) -> Any:
    """A call's arguments as the tool_use block's `input` object ({} if not JSON, e.g. cut short)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(finish_reason: str | None, matched: str | int | None, made_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the chat choice's finish."""
    if finish_reason == "length":
        return "max_tokens", None
    if made_calls or finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def usage_body(usage: p.Usage) -> dict[str, Any]:
    """Anthropic counts the cached prompt apart: input_tokens is the uncached rest."""
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not None else 0
    return {"input_tokens": usage.prompt_tokens - cached, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def message_body(message_id: str, model: str, content: list[dict[str, Any]], reason: str | None,
                 sequence: str | None, usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage}


def content_blocks(message: p.ChatResponseMessage) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.reasoning_content:
        blocks.append({"type": "thinking", "thinking": message.reasoning_content, "signature": ""})
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls or ():
        blocks.append({"type": "tool_use", "id": call.id, "name": call.function.name, "input": tool_input(call.function.arguments)})
    return blocks
