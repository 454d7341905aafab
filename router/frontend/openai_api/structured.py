"""OpenAI's `response_format` and vLLM's guided-decoding fields -> one StructuredOutput.

Accepted (the names vLLM's OpenAI server takes, so existing clients work):
  response_format  {"type": "text" | "json_object"} or
                   {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}
  guided_json (a schema, object or JSON text), guided_regex, guided_choice (a list of
  strings), guided_grammar (Lark or GBNF), and vLLM's newer `structured_outputs`
  {"json" | "regex" | "choice" | "grammar" | "json_object": ...}.
At most one constraint per request; an invalid one is a 400 here.
"""
from __future__ import annotations

import json
from typing import Any

from router.errors import bad_request
from worker.api import SamplingParamsError, StructuredOutput, check_structured_output

_STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json_object"}


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        return schema
    if isinstance(schema, (dict, bool)):
        return json.dumps(schema)
    raise bad_request("A JSON schema must be an object or a JSON string.", param)


def _from_response_format(fmt: dict[str, Any]) -> StructuredOutput | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec and "json_schema" not in spec:
            raise bad_request("response_format json_schema needs json_schema.schema.", "response_format")
        # OpenAI's shape is json_schema.schema; some clients send json_schema.json_schema.
        schema = spec.get("schema", spec.get("json_schema"))
        return StructuredOutput("json_schema", _schema_text(schema, "response_format"))
    raise bad_request(f"response_format type {str(kind)[:40]!r} is not supported (text, json_object, json_schema).", "response_format")


def _from_structured_outputs(spec: dict[str, Any]) -> list[StructuredOutput]:
    found = []
    for key, kind in _STRUCTURED_OUTPUTS_KEYS.items():
        value = spec.get(key)
        if value is None or value is False:
            continue
        if kind == "json_schema":
            found.append(StructuredOutput(kind, _schema_text(value, "structured_outputs")))
        elif kind == "choice":
            found.append(StructuredOutput(kind, json.dumps(value)))
        elif kind == "json_object":
            found.append(StructuredOutput(kind))
        else:
            found.append(StructuredOutput(kind, str(value)))
    return found


_CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def has_grammar(request: Any) -> bool:
    """Whether converting the request compiles a grammar (a constraint, or a forced tool
    call): work to keep off the event loop."""
    if any(getattr(request, name, None) is not None for name in _CONSTRAINT_FIELDS):
        return True
    tool_choice = getattr(request, "tool_choice", None)
    return bool(getattr(request, "tools", None)) and tool_choice not in (None, "auto", "none")


def structured_output_of(request: Any) -> StructuredOutput | None:
    """The request's one constraint (checked: it compiles), or None."""
    found: list[StructuredOutput] = []
    try:
        if request.response_format is not None:
            so = _from_response_format(request.response_format)
            if so is not None:
                found.append(so)
        if request.guided_json is not None:
            found.append(StructuredOutput("json_schema", _schema_text(request.guided_json, "guided_json")))
        if request.guided_regex is not None:
            found.append(StructuredOutput("regex", request.guided_regex))
        if request.guided_choice is not None:
            found.append(StructuredOutput("choice", json.dumps(request.guided_choice)))
        if request.guided_grammar is not None:
            found.append(StructuredOutput("grammar", request.guided_grammar))
        if request.structured_outputs is not None:
            found += _from_structured_outputs(request.structured_outputs)
        if len(found) > 1:
            raise bad_request("Only one of response_format, guided_* and structured_outputs may constrain a request.")
        if not found:
            return None
        check_structured_output(found[0])
    except SamplingParamsError as e:
        raise bad_request(str(e), "response_format") from None
    return found[0]
