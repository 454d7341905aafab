"""The /v1/messages and /v1/messages/count_tokens bodies as the official `anthropic` client
sends them (pydantic v2). Unknown fields are refused (400). Content blocks stay plain dicts
here: router/frontend/messages_api/translate.py reads them and refuses what kvserve does not
serve (images, documents, server tools) with Anthropic's error shape, never dropping them.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from worker.api import MAX_STOP_STRINGS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Tool(_Strict):
    """A client tool: its name, description and the JSON schema of its input."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


# Anthropic's floor on an extended-thinking budget (thinking.budget_tokens).
MIN_THINKING_BUDGET = 1024


class Thinking(_Strict):
    """`enabled` takes a budget of at least MIN_THINKING_BUDGET tokens, below the request's
    max_tokens (MessagesRequest checks that); the others take none."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: str | None = None

    @model_validator(mode="after")
    def _budget(self) -> Thinking:
        if self.type == "enabled":
            if self.budget_tokens is None:
                raise ValueError("thinking.budget_tokens: Field required when thinking is enabled")
            if self.budget_tokens < MIN_THINKING_BUDGET:
                raise ValueError(f"thinking.budget_tokens: Input should be greater than or equal to {MIN_THINKING_BUDGET}")
        elif self.budget_tokens is not None:
            raise ValueError(f"thinking.budget_tokens: only thinking of type 'enabled' takes a budget, not {self.type!r}")
        return self


class Metadata(_Strict):
    user_id: str | None = None


class Conversation(_Strict):
    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @model_validator(mode="after")
    def _tools(self) -> Conversation:
        choice = self.tool_choice
        if choice is not None and choice.type == "tool":
            if choice.name not in {t.name for t in self.tools or ()}:
                raise ValueError(f"tool_choice names {choice.name!r}, which is not in tools")
        elif choice is not None and choice.type == "any" and not self.tools:
            raise ValueError("tool_choice 'any' needs tools")
        if choice is not None and choice.type in ("any", "tool") and self.thinking is not None and self.thinking.type == "enabled":
            raise ValueError("Thinking may not be enabled when tool_choice forces tool use.")
        return self


class MessagesRequest(Conversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    # Anthropic's ranges; the 2.x client sends these as body extras.
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget >= self.max_tokens:
            raise ValueError("`max_tokens` must be greater than `thinking.budget_tokens`")
        return self


class CountTokensRequest(Conversation):
    cache_control: dict[str, Any] | None = None
