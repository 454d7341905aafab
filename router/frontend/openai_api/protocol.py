"""OpenAI-shaped request and response bodies (pydantic v2).

Requests reject unknown fields (`extra="forbid"`), as OpenAI's API does ("Unrecognized
request argument supplied"). Fields OpenAI knows but kvserve does not implement are
accepted only at their neutral value (e.g. `functions` empty), so that a client never gets a
silently different behaviour. vLLM's sampling extensions (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, ...) are accepted as well; the
official client sends them through `extra_body`.

Ranges follow OpenAI where it defines them; the engine's SamplingParams re-validates.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from worker.api import MAX_CACHE_SALT_CHARS, MAX_PRIORITY, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS, MAX_STOP_STRINGS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


MAX_CHAT_TEMPLATE_KWARGS = 16
# apply_chat_template's parameters (transformers 5) and the template's own inputs.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "bos_token", "eos_token", "raise_exception", "strftime_now",
})


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


class _SamplingFields(_Strict):
    """The fields completions and chat share."""

    model: str
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM extensions.
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: disabled
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: every prompt token's logprob and top-k (not with stream, as vLLM).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: the request's prefix-cache partition (worker/api.py SamplingParams.cache_salt).
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # vLLM's: lower values are served first (admission bands, engine preemption). Unset: the
    # API key's default band (ingress.key_priorities); a key cannot ask for a better one.
    priority: int | None = Field(None, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    # Structured outputs (router/frontend/openai_api/structured.py): OpenAI's response_format, vLLM's guided_*
    # and structured_outputs. At most one per request.
    response_format: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # vLLM's; one backend here (llguidance)
    guided_whitespace_pattern: str | None = None  # vLLM's; accepted, compact JSON is used
    structured_outputs: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        """OpenAI's shape: token id (a JSON string key) -> bias in [-100, 100]. Ids past
        the vocabulary are checked where the tokenizer is known (openai_api/convert.py)."""
        if not v:
            return v
        if len(v) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        for key, bias in v.items():
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key[:40]!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {key}")
        return v

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items())

    @model_validator(mode="after")
    def _unsupported(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available when stream is true")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) == 0:
            raise ValueError("the prompt must not be empty")
        return v

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """What the engine computes: prompt_logprobs, and with echo + logprobs the
        echoed tokens' logprobs too (OpenAI's shape; each use is cut to its own k)."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

    @model_validator(mode="after")
    def _unsupported_completion(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported by this server")
        return self


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: FunctionName


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI, still sent
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Tool calling (router/frontend/tool_calling/chat_tools.py).
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Known to OpenAI (deprecated); accepted only at a neutral value.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # At most this many tokens of thinking (<think> models), then the engine closes the
    # section and the answer follows (router/frontend/reasoning/budget.py).
    thinking_token_budget: int | None = Field(None, ge=0)
    # vLLM extensions for the template.
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """Only plain template variables (`enable_thinking: false`): never
        apply_chat_template's own arguments (a client's `chat_template` would be a template
        of its choosing, run on the ingress: a nested loop stalls it), nor nested values."""
        if not v:
            return v
        if len(v) > MAX_CHAT_TEMPLATE_KWARGS:
            raise ValueError(f"at most {MAX_CHAT_TEMPLATE_KWARGS} chat_template_kwargs are allowed")
        for key, value in v.items():
            if key in _RESERVED_TEMPLATE_KWARGS or not key.isidentifier() or key.startswith("_"):
                raise ValueError(f"{key[:40]!r} is not allowed in chat_template_kwargs")
            if value is not None and not isinstance(value, (bool, int, float, str)):
                raise ValueError("chat_template_kwargs values must be strings, numbers, booleans or null")
            if isinstance(value, str) and len(value) > 1024:
                raise ValueError("chat_template_kwargs strings may have at most 1024 characters")
        return v

    @model_validator(mode="after")
    def _unsupported_chat(self) -> ChatCompletionRequest:
        if self.functions or self.function_call not in (None, "none"):
            raise ValueError("functions / function_call are deprecated; use tools / tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or ()}
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        elif self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        if self.modalities is not None and self.modalities != ["text"]:
            raise ValueError("only the 'text' modality is supported")
        if self.audio is not None or self.prediction is not None or self.web_search_options is not None:
            raise ValueError("audio, prediction and web_search_options are not supported by this server")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# The response half of the schema (router/frontend/openai_api/response_bodies.py), re-exported.
from router.frontend.openai_api.response_bodies import (  # noqa: E402,F401
    PromptTokensDetails,
    Usage,
    PromptLogprob,
    CompletionLogprobs,
    CompletionChoice,
    CompletionResponse,
    TopLogprob,
    TokenLogprobContent,
    ChatLogprobs,
    FunctionCall,
    ToolCall,
    DeltaFunctionCall,
    DeltaToolCall,
    ChatResponseMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChatDelta,
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChunk,
    ModelCard,
    ModelList,
)
