"""Responses input items -> chat messages, the one conversation both APIs render.

    item                                   chat message
    "text" (the whole input a string)      {"role": "user", "content": text}
    message (role, text or input_text /    {"role": role, "content": text}
      output_text parts)
    function_call (call_id, name,          an assistant message's tool_calls entry; consecutive
      arguments)                           calls join the assistant message before them, so a
                                           turn that said something and then called tools
                                           renders as the one chat message it was
    function_call_output (call_id, output) {"role": "tool", "tool_call_id": ..., "content": ...}
    reasoning                              dropped (chat templates drop past thinking too)

Anything else (images, files, built-in tools' items, item references) is a 400: never
silently left out of the prompt.
"""
from __future__ import annotations

from typing import Any

from router.errors import bad_request

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")


def chat_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's `input` as chat messages (plain dicts, ChatMessage's shape)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for position, item in enumerate(items):
        kind = item.get("type", "message" if "role" in item else None)
        param = f"input[{position}]"
        if kind == "message":
            messages.append(_message(item, param))
        elif kind == "function_call":
            _add_call(messages, item, param)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _text_field(item, "call_id", param),
                             "content": _output_text(item.get("output"), param)})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"Input items of type {str(kind)[:40]!r} are not supported by this server.", param, "invalid_value")
    return messages


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"Invalid value for '{param}.role': must be one of {', '.join(_ROLES)}.", f"{param}.role", "invalid_value")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise bad_request(f"'{param}.content' must be a string or a list of content parts.", f"{param}.content", "invalid_value")
    return {"role": role, "content": "".join(_part_text(part, f"{param}.content[{i}]") for i, part in enumerate(content))}


def _part_text(part: Any, param: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
        return str(part["text"])
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return str(part["refusal"])
    raise bad_request(f"Content parts of type {str(kind)[:40]!r} are not supported by this server (text only).", param, "invalid_value")


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any], param: str) -> None:
    call = {"id": _text_field(item, "call_id", param), "type": "function",
            "function": {"name": _text_field(item, "name", param), "arguments": _text_field(item, "arguments", param)}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        return
    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _text_field(item: dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"Missing required parameter: '{param}.{name}'.", f"{param}.{name}", "missing_required_parameter")
    return value


def _output_text(output: Any, param: str) -> str:
    """A function_call_output's `output`: a string, or a list of text parts."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "".join(_part_text(part, f"{param}.output[{i}]") for i, part in enumerate(output))
    raise bad_request(f"Missing required parameter: '{param}.output'.", f"{param}.output", "missing_required_parameter")
