"""What a request must satisfy to enter an engine: checked at the engine's door, before
anything is allocated, so that a request that could never be served fails at once with
the reason (RequestError: HTTP 400 / gRPC INVALID_ARGUMENT) instead of in a step."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kv.cache_manager import cdiv
from kv.transfer import KVExport
from worker.api import KVImportError, RequestError, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """One engine's limits, as its requests meet them."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_total_blocks: int
    constrains: bool  # has a grammar compiler (a tokenizer): structured outputs work
    prompt_logprobs: bool  # its runner computes prompt logprobs
    # Blocks a sequence of n tokens holds at most, over its KV groups (kv/kv_groups.py);
    # None: one block per block_size tokens.
    blocks_needed: Callable[[int], int] | None = None


def check_request(prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits) -> None:
    """Raise RequestError for a request that could never be served."""
    n = len(prompt_token_ids)
    vocab_size, max_model_len = limits.vocab_size, limits.max_model_len
    if n == 0:
        raise RequestError("the prompt is empty")
    if n >= max_model_len:
        raise RequestError(
            f"the prompt has {n} tokens; max_model_len is {max_model_len} "
            f"(at least one output token must fit)"
        )
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        raise RequestError(f"prompt token ids must be in [0, {vocab_size})")
    if params.structured is not None and not limits.constrains:
        raise RequestError("this engine has no tokenizer, so it cannot constrain outputs")
    if params.prompt_logprobs is not None and not limits.prompt_logprobs:
        raise RequestError("prompt_logprobs is not supported by this engine (tensor parallelism or a simulated device)")
    if any(t >= vocab_size for t in params.stop_token_ids):
        raise RequestError(f"stop_token_ids must be in [0, {vocab_size})")
    thinking = params.thinking
    if thinking is not None and any(t >= vocab_size for t in thinking.start_token_ids + thinking.end_token_ids):
        raise RequestError(f"a thinking budget's marker token ids must be in [0, {vocab_size})")
    num_tokens = min(n + params.max_tokens, max_model_len)
    need = limits.blocks_needed(num_tokens) if limits.blocks_needed else cdiv(num_tokens, limits.block_size)
    if need > limits.num_total_blocks:
        raise RequestError(
            f"the request needs {need} KV blocks but the pool has {limits.num_total_blocks}; "
            f"shorten the prompt or max_tokens"
        )


def check_import_root(kv_import: KVExport, hash_root: int) -> None:
    """An imported prompt's KV must have been computed under the request's own hash root
    (the same LoRA adapter and cache salt): another root means other K and V."""
    if kv_import.hash_root != hash_root:
        raise KVImportError(f"the KV export of {kv_import.request_id!r} was computed under another LoRA adapter "
                            f"or cache salt than this request's")
