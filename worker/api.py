"""What other layers import from worker/: the request, output and error types, the
sampling parameters, the runner's output and the routing-stats record (defined in
worker/routing_stats.py, re-exported here).

Torch-free and Ray-free by design: router/ imports only this module of worker/, so the
ingress process never loads torch (tests/unit/test_layering.py asserts both). Everything
here is plain data; the engine, runner and replica that produce or consume it live in
their own modules and import it from here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# -- sampling parameters ----------------------------------------------------------------

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
    # preempt a running one of a worse band (worker/scheduler.py). The ingress bounds it per key.
    priority: int = 0
    # The API key it came with (the key's id; "" none) and the key's weight: within a band
    # the engine keeps each key to its weighted share of the running slots while another
    # key waits (worker/bands.py). Set by the ingress from its key table, never by a client.
    tenant: str = ""
    tenant_weight: int = 1
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


# -- requests and their outputs ---------------------------------------------------------


@dataclass(frozen=True)
class GenerateRequest:
    """What the ingress sends a worker: token ids, never text (workers never tokenize)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # A migrated request (router/frontend/migration.py): the last this-many prompt tokens are output
    # the client already has; the detokenizer replays them so text continues seamlessly.
    num_resumed_tokens: int = 0
    # The W3C trace context (`traceparent`, maybe `tracestate`) of the ingress span this
    # engine request belongs to, set only when tracing is on and the trace is sampled
    # (router/tracing.py). None: nothing on the worker side traces it (worker/tracing.py).
    trace_context: dict[str, str] | None = None
    # The client's session (router/routing/sessions.py's client_session_id): the request router's
    # soft affinity and its spread of new sessions. The engine ignores it.
    session_id: str | None = None
    # The caller's batched output stream (worker/output_streams.py): outputs leave through
    # the worker's `outputs(output_stream)` with every other request of that caller, once per
    # step, instead of one Ray object per output on this request's own call. None: per call.
    output_stream: str | None = None
    # False: the caller reads only the final text (a non-streamed response). On a batched
    # output stream the worker then sends the first output and the finished one, the
    # outputs between folded into the last (worker/output_streams.py).
    stream: bool = True
    # The LoRA adapter that serves it (None: the base model) and its PEFT directory: a worker
    # replica that does not know the adapter yet (one started after it was loaded) learns it.
    lora_name: str | None = None
    lora_path: str | None = None


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # The top-n alternatives, best first: (token_id, logprob).
    top: tuple[tuple[int, float], ...] = ()
    # 1-based rank of token_id in its distribution (set for prompt logprobs, as vLLM's).
    rank: int | None = None


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
    # On the request's first output only, when it asked for prompt_logprobs: one entry per
    # prompt token, the first None (nothing precedes it), as vLLM's.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    # time.monotonic() when the scheduler first admitted it (the end of its queue wait).
    scheduled_time: float | None = None
    num_preemptions: int = 0
    extra: dict = field(default_factory=dict)

    def absorb(self, later: RequestOutput) -> None:
        """Fold the request's next output into this one, as if both were one update: the
        tokens, text and logprobs of both in order, the later one's state and counts, the
        earlier one's one-time fields (prompt logprobs, first times). Outputs of one
        request that wait to leave together cross process boundaries as one object."""
        # In place: an output absorbs outputs while it waits to leave, and nothing else
        # holds its lists (the engine builds them per output), so a request held for its
        # whole answer costs one append per token, not a copy of all so far.
        self.new_token_ids.extend(later.new_token_ids)
        self.text_delta += later.text_delta
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(later.logprobs)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finished, self.finish_reason, self.stop_reason = later.finished, later.finish_reason, later.stop_reason
        self.num_prompt_tokens, self.num_output_tokens = later.num_prompt_tokens, later.num_output_tokens
        self.num_cached_tokens = later.num_cached_tokens
        self.error = later.error if later.error is not None else self.error
        if self.first_token_time is None:
            self.first_token_time = later.first_token_time
        if self.scheduled_time is None:
            self.scheduled_time = later.scheduled_time
        self.num_preemptions = later.num_preemptions
        if later.extra:
            self.extra = {**self.extra, **later.extra}


@dataclass
class RunnerOutput:
    """What a model runner's `execute(plan)` returns, aligned with plan.seqs."""

    token_ids: list[int | None]  # None where the seq did not sample
    logprobs: list[TokenLogprob | None]
    forward_s: float  # time in the model forward + logits (for the overhead figure)


# -- errors a caller can see ------------------------------------------------------------


class RequestError(ValueError):
    """A user-caused problem with a request (maps to HTTP 400 / gRPC INVALID_ARGUMENT)."""


class KVImportError(RequestError):
    """A KV export that this engine cannot import (layout mismatch, tokens that differ)."""


def lora_cache_key(name: str, path: str) -> str:
    """A LoRA adapter's prefix-cache identity (kv.block_hash.root_hash extra key): the
    engine and the router hash an adapter request's blocks from the same root."""
    return f"lora:{name}:{path}"


class LoRANotFoundError(RequestError):
    """The request names an adapter the worker does not know (HTTP 404 / gRPC NOT_FOUND)."""

    def __init__(self, name: str, known: list[str]) -> None:
        listed = ", ".join(sorted(known)) or "none"
        super().__init__(f"the LoRA adapter {name!r} does not exist; known adapters: {listed}")
        self.name, self.known = name, sorted(known)

    def __reduce__(self) -> tuple[type, tuple[str, list[str]]]:
        # Crosses from the worker to the ingress pickled: rebuilt from its own arguments.
        return type(self), (self.name, self.known)


class LoRAAdapterError(RequestError):
    """An adapter that cannot be loaded (missing or malformed files, wrong shapes, rank
    above max_lora_rank): HTTP 400 at load."""


class MissingDependencyError(ImportError):
    """A feature (or a checkpoint format) needs a package that does not import; the message
    says what to install. One class for every layer: cluster/deps.py builds its messages."""


class ReplicaDrainingError(RuntimeError):
    """This replica is being removed and takes no new requests; send it to another one."""


# -- the routing-stats record (its own module; re-exported: router/ imports it from here) --
from worker.routing_stats import ROUTING_STATS_KEYS, RoutingStats  # noqa: E402,F401


# -- the model's tokenizer (the ingress and the workers load it the same way) ----------------
GGUF_INSTALL_HINT = "pip install 'kvserve[gguf]' (the gguf and accelerate packages)"


def is_gguf(path: Path | str) -> bool:
    return str(path).lower().endswith(".gguf")


def require_gguf() -> None:
    """Raise MissingDependencyError, with the install hint, when `gguf` does not import."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise MissingDependencyError(f"loading a .gguf model needs the `gguf` package: {GGUF_INSTALL_HINT}") from None


def load_tokenizer(path: Path | str, trust_remote_code: bool = False) -> Any:
    """The model's tokenizer; a .gguf file's (vocabulary, merges, chat template) is built
    by transformers from the file itself. transformers is imported here, not at module
    import: this module stays light for the ingress (no torch)."""
    path = Path(path)
    if not is_gguf(path) and _tokenizer_class(path) in _GENERIC_TOKENIZER_CLASSES:
        # The class AutoTokenizer would pick anyway, without AutoTokenizer's import of
        # torch: 1.4 s of CPU instead of 5.4 s for the embedded model (a simulated-device
        # replica or an ingress never needs torch otherwise).
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    if is_gguf(path):
        require_gguf()
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


# tokenizer_config.json classes that name transformers' generic tokenizers.json-backed
# class itself (transformers 5 calls it TokenizersBackend, 4 PreTrainedTokenizerFast).
_GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def _tokenizer_class(model_dir: Path) -> str | None:
    """tokenizer_config.json's tokenizer_class, when the directory has a tokenizer.json."""
    config = model_dir / "tokenizer_config.json"
    if not (model_dir / "tokenizer.json").is_file() or not config.is_file():
        return None
    try:
        value = json.loads(config.read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, str) else None


def check_structured_output(so: StructuredOutput) -> None:
    """Raise SamplingParamsError when the spec does not compile to a grammar. Torch- and
    tokenizer-free, so the ingress answers an invalid schema with 400 before a worker
    sees it (the worker compiles it again, cached, against its tokenizer)."""
    from worker.structured.grammar import GrammarError, check

    try:
        check(so)
    except GrammarError as e:
        raise SamplingParamsError(str(e)) from None
