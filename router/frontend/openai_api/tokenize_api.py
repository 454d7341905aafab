"""vLLM's utility endpoints /tokenize, /detokenize and /version: their bodies (pydantic,
extra="forbid" like the OpenAI ones) and the tokenizer work behind them.

/tokenize returns the ids generation would see (a prompt tokenized as /v1/completions
does, messages rendered as /v1/chat/completions does) with the context length:
`{count, max_model_len, tokens}`; /detokenize `{tokens}` -> `{prompt}`; /version
`{version}`. The handlers are router/frontend/ingress.py's.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from router.frontend.openai_api import protocol as p
from router.errors import bad_request
from router.frontend.openai_api.convert import encode_chat


class TokenizeRequest(p._Strict):
    """vLLM's two shapes in one: a `prompt`, or chat `messages` rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[p.ChatMessage] | None = None
    # Unset: True for a prompt (BOS added, as generation does), False for messages (the
    # template writes its own), as vLLM.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("set exactly one of prompt and messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(p._Strict):
    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)

    @field_validator("tokens")
    @classmethod
    def _ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def tokenize_ids(request: TokenizeRequest, tokenizer: Any) -> list[int]:
    """The ids generation would see: a prompt as /v1/completions tokenizes it, messages
    as /v1/chat/completions renders them (vLLM's /tokenize)."""
    if request.messages is not None:
        chat = p.ChatCompletionRequest(
            model=request.model or "", messages=request.messages,
            add_generation_prompt=request.add_generation_prompt, chat_template_kwargs=request.chat_template_kwargs,
        )
        ids = encode_chat(tokenizer, chat)
        if request.add_special_tokens:
            ids = tokenizer.build_inputs_with_special_tokens(ids)
        return list(ids)
    add_special = True if request.add_special_tokens is None else request.add_special_tokens
    return list(tokenizer(request.prompt, add_special_tokens=add_special).input_ids)


def detokenize_text(request: DetokenizeRequest, tokenizer: Any) -> str:
    vocab = len(tokenizer)
    for token_id in request.tokens:
        if token_id >= vocab:
            raise bad_request(f"Token id {token_id} is outside the vocabulary (0..{vocab - 1}).", "tokens")
    return tokenizer.decode(request.tokens)
