"""Per-request state: one `Sequence` object holds everything the engine knows about a request.

Token layout (the one rule that covers prefill, chunked prefill, decode and recompute):

    token_ids:  [ p0 p1 ... p(P-1) | o0 o1 ... o(O-1) ]      P = num_prompt_tokens
                 <------ num_computed_tokens ------>
                                                     <- not yet in the KV cache ->

A step schedules `num_new_tokens` tokens starting at `num_computed_tokens`; it samples
a new token only when the step reaches the end (`num_computed + num_new == num_tokens`).
The token at position i lives in KV slot block_ids[i // block_size] * block_size + i % block_size.
"""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

from kv.block_hash import root_hash
from worker.api import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from kv.transfer import KVExport
    from worker.structured.state import GrammarState
    from worker.sampling.thinking import ThinkingState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    # Admitted with a prefix held in a tier below the device (worker/kvcache/tiers.py): its
    # blocks are allocated and being filled; it joins `running` once they are.
    LOADING = "loading"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    __slots__ = (
        "request_id",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_cached_tokens",
        "params",
        "hash_root",
        "status",
        "finish_reason",
        "stop_reason",
        "arrival_time",
        "first_token_time",
        "scheduled_time",
        "num_preemptions",
        "sampler_state",
        "eos_token_ids",
        "kv_import",
        "grammar",
        "thinking",
        "prompt_logprobs",
        "waiting_uncached_tokens",
        "lora_name",
        "lora_slot",
        "quiet_from",
        "session_id",
        "num_resumed_tokens",
        "num_draft_tokens",
        "num_accepted_draft_tokens",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at admission
        self.params = params
        # The root of its block-hash chain: its prefix-cache partition (kv/block_hash.py).
        self.hash_root = root_hash(params.cache_keys)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        # When the scheduler first admitted it (queue wait = scheduled - arrival); set once,
        # a preempted sequence's readmission does not move it.
        self.scheduled_time: float | None = None
        self.num_preemptions = 0
        # Opaque per-request state owned by the sampler (e.g. a seeded torch.Generator).
        self.sampler_state: Any = None
        self.eos_token_ids = eos_token_ids
        # Disaggregation, decode side: the prompt's KV computed elsewhere, until admission
        # writes it into this sequence's blocks (worker/kvcache/connector.py); then None.
        self.kv_import: KVExport | None = None
        # Structured outputs: the request's grammar (worker/structured/state.py), else None.
        self.grammar: GrammarState | None = None
        # A thinking budget (SamplingParams.thinking): its count and forced end marker
        # (worker/sampling/thinking.py), else None.
        self.thinking: ThinkingState | None = None
        # prompt_logprobs requests: entries for prompt tokens 1..len (token 0 has none),
        # appended by the runner chunk by chunk; their count says where the next chunk
        # resumes, so a preempted prefill never emits a token's entry twice.
        self.prompt_logprobs: list[TokenLogprob] | None = [] if params.prompt_logprobs is not None else None
        # While waiting: the tokens admission would compute, as the prefix cache stood when
        # it joined the queue (Scheduler.waiting_uncached_tokens, the router's backlog).
        self.waiting_uncached_tokens = 0
        # The LoRA adapter serving it (None: the base model) and, while it is running, the
        # device slot holding that adapter (worker/lora/slots.py; -1 otherwise).
        self.lora_name: str | None = None
        self.lora_slot = -1
        # A quiet request (Engine.add_request): the index in token_ids after the tokens its
        # outputs carried so far; None for one that gets an output every step.
        self.quiet_from: int | None = None
        # The client's session (GenerateRequest.session_id): with session KV retention on,
        # its blocks are kept for the session's next turn when it finishes (kv/retention.py).
        self.session_id: str | None = None
        # A migrated request: its last prompt tokens that are output of an earlier attempt
        # (Engine.add_request); its grammar starts past them.
        self.num_resumed_tokens = 0
        # Speculative decoding (worker/spec/): draft tokens verified for it, and accepted.
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
