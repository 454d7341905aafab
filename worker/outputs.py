"""What the engine hands back, per request, per step."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # The top-n alternatives, best first: (token_id, logprob).
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """One streamed update for one request: the tokens produced since the last update."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str = ""
    finished: bool = False
    # "stop" (EOS, stop token, stop string), "length" (max_tokens / max_model_len),
    # "abort" (caller went away or aborted), "error" (the step failed; see `error`).
    finish_reason: str | None = None
    # The stop string or stop token id that ended the request, when one did.
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    extra: dict = field(default_factory=dict)
