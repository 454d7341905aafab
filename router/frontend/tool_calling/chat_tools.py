"""Tool calling for chat: what the template sees, what the output is held to, and how
the output becomes `tool_calls`.

    tool_choice   prompt renders tools   output constrained to          parsed by
    none / unset  no (as vLLM: none      -                              -
      + no tools    drops the tools)
    auto          yes                    - (the model decides)          the model's parser
    required      yes                    a JSON array of calls, >= 1    JsonArrayParser
                                         (1 when parallel_tool_calls is false)
    named         yes                    the function's parameters      NamedParser
The constraints are structured outputs (worker/structured/), as vLLM does it, so a
`required` or named call always parses unless max_tokens cuts it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from router.frontend.openai_api import protocol as p
from router.errors import bad_request
from router.frontend.openai_api.structured import structured_output_of
from router.frontend.tool_calling.calls import CallDelta, ParsedCall
from router.frontend.tool_calling.parsers import JsonArrayParser, NamedParser, ToolParser
from router.frontend.tool_calling.registry import PARSERS, parser_for_template
from worker.api import SamplingParamsError, StructuredOutput, check_structured_output

_ANY_PARAMETERS: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolMode:
    """How one chat request's output is turned into tool calls."""

    choice: str  # auto | required | named
    parser: str  # hermes | llama3_json | deepseek_v3 | mistral (auto only)
    function: str | None = None  # named

    @property
    def keeps_special_tokens(self) -> bool:
        """The output must keep special tokens: the format's markers are some."""
        return self.choice == "auto" and PARSERS[self.parser].keeps_special_tokens

    def new_parser(self) -> ToolParser:
        if self.choice == "required":
            return JsonArrayParser()
        if self.choice == "named":
            assert self.function is not None
            return NamedParser(self.function)
        return PARSERS[self.parser]()

    @property
    def finish_reason(self) -> str:
        # OpenAI: a forced named call finishes with "stop"; otherwise "tool_calls".
        return "stop" if self.choice == "named" else "tool_calls"


def tool_mode(request: p.ChatCompletionRequest, parser: str, chat_template: str | None) -> ToolMode | None:
    """None when tools play no part in this request."""
    if not request.tools or request.tool_choice == "none":
        return None
    name = parser if parser != "auto" else parser_for_template(chat_template)
    if isinstance(request.tool_choice, p.NamedToolChoice):
        return ToolMode("named", name, request.tool_choice.function.name)
    return ToolMode(request.tool_choice or "auto", name)


def tools_for_template(request: p.ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as the chat template expects them (OpenAI's shape), or None."""
    if not request.tools or request.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in request.tools]


def tool_constraint(request: p.ChatCompletionRequest, mode: ToolMode | None) -> StructuredOutput | None:
    """The structured output that forces a `required` or named call."""
    if mode is None or mode.choice == "auto":
        return None
    tools = {t.function.name: t.function for t in request.tools or ()}
    if mode.choice == "named":
        assert mode.function is not None
        return StructuredOutput("json_schema", json.dumps(tools[mode.function].parameters or _ANY_PARAMETERS))
    definitions: dict[str, Any] = {}
    calls = []
    for position, (name, fn) in enumerate(tools.items()):
        parameters = _hoist_definitions(fn.parameters or _ANY_PARAMETERS, f"tool{position}_", definitions)
        calls.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if definitions:
        schema["$defs"] = definitions
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return StructuredOutput("json_schema", json.dumps(schema))


_DEFINITION_KEYS = ("$defs", "definitions")


def _hoist_definitions(parameters: dict[str, Any], prefix: str, definitions: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema nested in the `required` array schema: its local
    definitions (`$defs`, `definitions`) move to the combined schema's root under
    `prefix`ed names, and its `#/$defs/...` references follow them, because a `$ref`
    pointer is resolved from the root of the whole document. The prefix keeps two tools'
    same-named definitions apart."""
    local = {key: parameters[key] for key in _DEFINITION_KEYS if isinstance(parameters.get(key), dict)}
    if not local:
        return parameters
    renamed = {f"#/{key}/{name}": f"#/$defs/{prefix}{name}" for key, defs in local.items() for name in defs}

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items()}
            ref = out.get("$ref")
            if isinstance(ref, str):
                for old, new in renamed.items():
                    if ref == old or ref.startswith(old + "/"):
                        out["$ref"] = new + ref[len(old):]
                        break
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for key, defs in local.items():
        for name, definition in defs.items():
            definitions[f"{prefix}{name}"] = rewrite(definition)
    return rewrite({k: v for k, v in parameters.items() if k not in _DEFINITION_KEYS})


def template_message(message: p.ChatMessage) -> dict[str, Any]:
    """A request message as the chat template sees it (tool calls' arguments as objects,
    as Hermes / Llama templates render them)."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name:
        out["name"] = message.name
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    pass  # rendered as the text it is
            calls.append({**call, "function": fn})
        out["tool_calls"] = calls
    return out


def tool_calls_of(calls: list[ParsedCall]) -> list[p.ToolCall]:
    return [p.ToolCall(id=c.id, function=p.FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


def delta_tool_calls(deltas: list[CallDelta]) -> list[p.DeltaToolCall]:
    """The parser's call deltas on the wire, as OpenAI streams them: a call's first delta
    has id, type and name (and empty arguments), the later ones argument fragments only."""
    out = []
    for d in deltas:
        if d.id is not None:
            out.append(p.DeltaToolCall(index=d.index, id=d.id, type="function",
                                       function=p.DeltaFunctionCall(name=d.name, arguments=d.arguments)))
        elif d.arguments:
            out.append(p.DeltaToolCall(index=d.index, function=p.DeltaFunctionCall(arguments=d.arguments)))
    return out


def chat_structured_output(request: p.ChatCompletionRequest, mode: ToolMode | None) -> StructuredOutput | None:
    """A forced tool call's constraint, or the request's response_format / guided_*."""
    try:
        forced = tool_constraint(request, mode)  # the spec's own bounds are checked as it is built
    except SamplingParamsError as e:
        raise bad_request(f"The tools' constraint is too large: {e}", "tools") from None
    requested = structured_output_of(request)
    if forced is not None and requested is not None:
        raise bad_request("A required or named tool_choice cannot be combined with response_format or guided_*.", "tool_choice")
    if forced is not None:
        try:
            check_structured_output(forced)
        except SamplingParamsError as e:
            raise bad_request(f"The tool's parameters are not a valid JSON schema: {e}", "tools") from None
    return forced or requested
