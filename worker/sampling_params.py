"""Sampling parameters: what a request asks of sampling (`SamplingParams`), the
structured-output constraint it may carry (`StructuredOutput`), and the bounds both are
validated against once, at the engine's door.

Plain data, torch-free: the ingress builds and checks these before a worker sees the
request. Other layers import them from worker/api.py, which re-exports this module.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from worker.structured.grammar import GrammarError, check

# Bounds that keep one request from taking the whole engine down (unbounded `n` and
# `top_logprobs` have crashed other servers).
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_PRIORITY = 1_000_000
MAX_TENANT_CHARS = 64  # a key id is 12 hex digits; room for other principals' names
MAX_CACHE_SALT_CHARS = 1024  # a client's; the engine takes room for the ingress's key frame too
_CACHE_SALT_FRAME_CHARS = 64
# OpenAI's logit_bias: at most this many entries, each bias in [-100, 100].
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGIT_BIAS = 100.0


class SamplingParamsError(ValueError):
    """A user-caused problem with sampling parameters (maps to HTTP 400)."""


# What a structured-output constraint may be (vLLM's guided_* names, minus the prefix).
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_STRUCTURED_SPEC_CHARS = 256 * 1024


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output's text, compiled into a grammar by the worker
    (worker/structured/). Hashable: the compiled grammar is cached by it.

    `spec` by kind: json_schema: the schema as JSON text; regex: the pattern; choice: a
    JSON list of the allowed strings; grammar: a Lark (or GBNF) grammar; json_object: "".
    """

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise SamplingParamsError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_STRUCTURED_SPEC_CHARS:
            raise SamplingParamsError(f"a structured output spec is a string of at most {MAX_STRUCTURED_SPEC_CHARS} characters")


# A thinking budget's markers: at most this many token ids each.
MAX_THINKING_MARKER_IDS = 16


@dataclass(frozen=True)
class ThinkingBudget:
    """At most `max_tokens` tokens inside the reasoning section (between `start_token_ids`
    and `end_token_ids`, the `<think>` / `</think>` tags as the model's tokenizer encodes
    them); then the engine forces `end_token_ids` and the answer follows
    (worker/sampling/thinking.py). `starts_inside`: the prompt already opened the section
    (a chat template whose generation prompt ends with the start tag); otherwise an output
    that opens with `start_token_ids` enters it."""

    max_tokens: int
    start_token_ids: tuple[int, ...]
    end_token_ids: tuple[int, ...]
    starts_inside: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise SamplingParamsError(f"a thinking budget is an integer >= 0, got {self.max_tokens!r}")
        for name, ids in (("start", self.start_token_ids), ("end", self.end_token_ids)):
            if not 0 < len(ids) <= MAX_THINKING_MARKER_IDS or any(not isinstance(t, int) or t < 0 for t in ids):
                raise SamplingParamsError(f"a thinking budget's {name} marker is 1 to {MAX_THINKING_MARKER_IDS} token ids >= 0")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, validated once at the engine's door."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None = off; k >= 0 = chosen token + top-k
    # vLLM's prompt_logprobs: every prompt token's logprob (+ top-k) from the prefill's
    # own logits. Such a request never reads the prefix cache (a cached block has no logits).
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    detokenize: bool = True
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None  # constrain the output (a grammar)
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's cache_salt: the request's prefix-cache partition. Blocks are shared only with
    # requests of the same salt (kv/block_hash.py seeds the hash chain's root with it).
    cache_salt: str | None = None
    # vLLM's priority: lower values are served first; a waiting request of a better band may
    # preempt a running one of a worse band (worker/scheduling/preemption.py). The ingress bounds it per key.
    priority: int = 0
    # The API key it came with (the key's id; "" none) and the key's weight: within a band
    # the engine keeps each key to its weighted share of the running slots while another
    # key waits (worker/scheduling/bands.py). Set by the ingress from its key table, never by a client.
    tenant: str = ""
    tenant_weight: int = 1
    # Anthropic's thinking budget_tokens: the reasoning section's length, enforced by forcing
    # its end marker (None: unbounded).
    thinking: ThinkingBudget | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def cache_keys(self) -> tuple[str, ...]:
        """The extra keys of this request's block-hash chain (kv/block_hash.py root_hash):
        what, besides its tokens, decides whose cached KV it may reuse."""
        return () if self.cache_salt is None else (self.cache_salt,)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self) -> None:
        def bad(msg: str) -> SamplingParamsError:
            return SamplingParamsError(msg)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 2.0:
            raise bad(f"temperature must be in [0, 2], got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise bad(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS + _CACHE_SALT_FRAME_CHARS
        ):
            raise bad(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
        if not isinstance(self.priority, int) or not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise bad(f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}]")
        if not isinstance(self.tenant, str) or len(self.tenant) > MAX_TENANT_CHARS:
            raise bad(f"tenant must be a string of at most {MAX_TENANT_CHARS} characters")
        if not isinstance(self.tenant_weight, int) or self.tenant_weight < 1:
            raise bad(f"tenant_weight must be an integer >= 1, got {self.tenant_weight!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop strings must be non-empty strings")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise bad(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative integers")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise bad(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        self._validate_logit_bias()

    def _validate_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise SamplingParamsError(f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        for token_id, bias in self.logit_bias:
            if not isinstance(token_id, int) or token_id < 0:
                raise SamplingParamsError(f"logit_bias keys must be token ids >= 0, got {token_id!r}")
            if not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise SamplingParamsError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token_id}")


def check_structured_output(so: StructuredOutput) -> None:
    """Raise SamplingParamsError when the spec does not compile to a grammar. Torch- and
    tokenizer-free, so the ingress answers an invalid schema with 400 before a worker
    sees it (the worker compiles it again, cached, against its tokenizer)."""
    try:
        check(so)
    except GrammarError as e:
        raise SamplingParamsError(str(e)) from None
