"""What other layers import from worker/: the request, output and error types, the
runner's output and the tokenizer loader, with the sampling parameters (defined in
worker/sampling_params.py) and the routing-stats record (worker/serving/routing_stats.py)
re-exported here.

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

# -- sampling parameters (their own module; re-exported: other layers import them from here) --
from worker.sampling_params import (  # noqa: F401
    MAX_CACHE_SALT_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_PRIORITY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STRUCTURED_SPEC_CHARS,
    MAX_TENANT_CHARS,
    MAX_THINKING_MARKER_IDS,
    STRUCTURED_KINDS,
    SamplingParams,
    SamplingParamsError,
    StructuredOutput,
    ThinkingBudget,
    check_structured_output,
)

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
    # (router/tracing.py). None: nothing on the worker side traces it (worker/serving/tracing.py).
    trace_context: dict[str, str] | None = None
    # The client's session (router/routing/sessions.py's client_session_id): the request router's
    # soft affinity and its spread of new sessions; the engine keeps a finished turn's KV
    # for the session's next turn (CacheConfig.session_kv_ttl_s, kv/retention.py).
    session_id: str | None = None
    # The caller's batched output stream (worker/outputs/streams.py): outputs leave through
    # the worker's `outputs(output_stream)` with every other request of that caller, once per
    # step, instead of one Ray object per output on this request's own call. None: per call.
    output_stream: str | None = None
    # False: the caller reads only the final text (a non-streamed response). On a batched
    # output stream the worker then sends the first output and the finished one, the
    # outputs between folded into the last (worker/outputs/streams.py).
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
    # Speculative decoding (worker/spec/): plan index of a verify row -> every token it
    # yields (accepted drafts, then the target's own); token_ids holds the first of them.
    verified_token_ids: dict[int, list[int]] | None = None


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


class UnsupportedModelError(ValueError):
    """A checkpoint kvserve cannot serve exactly (caught by `kvserve serve` before Ray
    starts). Here, not in model_config.py, so that the per-family checks model_config.py
    runs can raise it without importing their caller."""


class MissingDependencyError(ImportError):
    """A feature (or a checkpoint format) needs a package that does not import; the message
    says what to install. One class for every layer: cluster/deps.py builds its messages."""


class ReplicaDrainingError(RuntimeError):
    """This replica is being removed and takes no new requests; send it to another one."""


# -- the routing-stats record (its own module; re-exported: router/ imports it from here) --
from worker.serving.routing_stats import ROUTING_STATS_KEYS, RoutingStats  # noqa: E402,F401


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
    from transformers import AutoTokenizer  # transformers: the ingress imports this module

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
