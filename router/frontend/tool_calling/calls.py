"""A tool call's records, shared by the parsers (router/frontend/tool_calling/parsers.py)
and the call streamer (call_stream.py): a parsed call, one stream delta of a call, a call's
id, and a {"name", "arguments" | "parameters"} object read as a call."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CallDelta:
    """One stream delta of one call: `index` counts the choice's calls from 0; the first
    delta of a call carries its id and name, the later ones argument text only."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)


def call_from_json(obj: Any) -> ParsedCall | None:
    """A {"name", "arguments" | "parameters"} object as a call; None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models put the JSON text in a string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))
