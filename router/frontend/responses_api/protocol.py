"""The /v1/responses request body as the official `openai` client sends it (pydantic v2).

Unknown fields are refused (400), as OpenAI does. Fields the spec has but kvserve does not
implement are accepted only at their neutral value (built-in tools, background mode,
conversations, prompt templates are refused), so that a client never gets a silently
different behaviour. Input items stay plain dicts here: router/frontend/responses_api/items.py
reads them into chat messages and words each problem as a 400.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from worker.api import MAX_LOGPROBS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionTool(_Strict):
    """A function tool, flat as the Responses API spells it (chat nests it in `function`)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    """`text.format`: plain text, a JSON object, or output held to a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TextOptions(_Strict):
    format: TextFormat | None = None
    verbosity: str | None = None


class Reasoning(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None
    generate_summary: str | None = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None


class ResponsesRequest(_Strict):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: Reasoning | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    # Known to the spec; accepted only at their neutral value.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    # vLLM's sampling extensions, sent through the client's extra_body.
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=0, lt=2**63)

    @model_validator(mode="after")
    def _unsupported(self) -> ResponsesRequest:
        if self.background:
            raise ValueError("background mode is not supported by this server")
        if self.conversation is not None or self.prompt is not None:
            raise ValueError("conversation and prompt templates are not supported by this server; use previous_response_id")
        if self.max_tool_calls is not None:
            raise ValueError("max_tool_calls is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise ValueError("input must not be empty")
        if isinstance(self.tool_choice, NamedFunction):
            if self.tool_choice.name not in {t.name for t in self.tools or ()}:
                raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not in tools")
        elif self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        return self
