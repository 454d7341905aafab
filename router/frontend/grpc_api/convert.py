"""Conversion between the gRPC API's messages (protos/kvserve/v1/kvserve.proto) and the
engine / OpenAI side: request messages -> OpenAI request bodies -> EngineInputs, engine
outputs -> response fields, worker stats -> ReplicaStats, APIError -> gRPC status code.

Pure functions and values, no RPC plumbing: the RPC methods that use them are
router/frontend/grpc_api/servicer.py's GrpcServicer. Requests are validated through the OpenAI
request models (router/frontend/openai_api/protocol.py), so both APIs accept and reject the same
values with the same messages.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from protos.kvserve.v1 import kvserve_pb2 as pb
from router import errors
from router.frontend.openai_api import convert as convert
from router.frontend.openai_api import protocol as p
from worker.api import RequestOutput, TokenLogprob

STATUS_CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

FINISH_REASONS: dict[str | None, int] = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}

# GenerateRequest fields that are `optional` in the proto: sent only when set, so that
# the OpenAI models' defaults (temperature 1, top_p 1, ...) apply otherwise.
_OPTIONAL_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "skip_special_tokens",
)
_FLOAT_FIELDS = frozenset({"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"})


def status_code_of(error: errors.APIError) -> grpc.StatusCode:
    return STATUS_CODES.get(error.status, grpc.StatusCode.UNKNOWN)


def _proto_float(value: float) -> float:
    """A proto `float` arrives as float32 (0.7 -> 0.699999988...): back to its decimal."""
    return float(f"{value:.7g}")


def _messages(messages: Any) -> list[dict[str, Any]]:
    return [{"role": m.role, "content": m.content} | ({"name": m.name} if m.name else {}) for m in messages]


def sampling_body(request: pb.GenerateRequest) -> dict[str, Any]:
    """The sampling fields of a GenerateRequest as an OpenAI request body's fields."""
    body: dict[str, Any] = {}
    for name in _OPTIONAL_SAMPLING_FIELDS:
        if request.HasField(name):
            value = getattr(request, name)
            body[name] = _proto_float(value) if name in _FLOAT_FIELDS else value
    if request.stop:
        body["stop"] = list(request.stop)
    if request.stop_token_ids:
        body["stop_token_ids"] = list(request.stop_token_ids)
    if request.logit_bias:
        body["logit_bias"] = {str(t): _proto_float(b) for t, b in request.logit_bias.items()}
    if request.HasField("n"):
        body["n"] = request.n
    if request.HasField("prompt_logprobs"):
        body["prompt_logprobs"] = request.prompt_logprobs
    if request.HasField("cache_salt"):
        body["cache_salt"] = request.cache_salt
    if request.HasField("priority"):
        body["priority"] = request.priority
    body.update(_constraint_body(request))
    body["ignore_eos"] = request.ignore_eos
    body["min_tokens"] = request.min_tokens
    body["include_stop_str_in_output"] = request.include_stop_str_in_output
    return body


def _constraint_body(request: pb.GenerateRequest) -> dict[str, Any]:
    """The `constraint` oneof as the HTTP API's fields (router/frontend/openai_api/structured.py checks it)."""
    kind = request.WhichOneof("constraint")
    if kind == "json_schema":
        return {"guided_json": request.json_schema}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}} if request.json_object else {}
    if kind == "regex":
        return {"guided_regex": request.regex}
    if kind == "choice":
        return {"guided_choice": list(request.choice.choices)}
    if kind == "grammar":
        return {"guided_grammar": request.grammar}
    return {}


def num_choices(request: pb.GenerateRequest, max_n: int) -> int:
    """The request's n (1 when unset), checked against the server's max_n (APIError 400)."""
    n = request.n if request.HasField("n") else 1
    if n < 1:
        raise errors.bad_request(f"n must be at least 1, got {n}.", "n", "invalid_value")
    convert.check_n(n, max_n)
    return n


def engine_inputs(
    request: pb.GenerateRequest, model: str, tokenizer: Any, max_model_len: int, max_n: int = 1
) -> list[convert.EngineInput]:
    """One EngineInput (token ids + SamplingParams) per choice of a GenerateRequest, validated with the
    OpenAI request models, so that both APIs accept and reject the same values with the
    same messages. Raises APIError (400) for anything invalid or too long."""
    given = [name for name, present in (
        ("prompt", bool(request.prompt)),
        ("prompt_token_ids", len(request.prompt_token_ids) > 0),
        ("messages", len(request.messages) > 0),
    ) if present]
    if len(given) != 1:
        which = "none was" if not given else f"got {', '.join(given)}"
        raise errors.bad_request(f"Set exactly one of prompt, prompt_token_ids and messages ({which}).", "prompt")
    max_tokens = request.max_tokens if request.HasField("max_tokens") else None
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, **sampling_body(request)}
    logprobs = request.logprobs if request.HasField("logprobs") else None
    if request.messages:
        if request.echo:
            raise errors.bad_request("echo needs prompt or prompt_token_ids, not messages.", "echo")
        body["messages"] = _messages(request.messages)
        if logprobs is not None:
            body.update(logprobs=True, top_logprobs=logprobs)
        if request.HasField("add_generation_prompt"):
            body["add_generation_prompt"] = request.add_generation_prompt
        return convert.chat_inputs(errors.validated(p.ChatCompletionRequest, body), tokenizer, max_model_len, max_n)
    body["prompt"] = request.prompt or list(request.prompt_token_ids)
    body["logprobs"] = logprobs
    body["echo"] = request.echo
    return convert.completion_inputs(errors.validated(p.CompletionRequest, body), tokenizer, max_model_len, max_n)


def tokenize(request: pb.TokenizeRequest, model: str, tokenizer: Any) -> list[int]:
    """A TokenizeRequest's token ids, as generation would compute them."""
    if bool(request.prompt) == bool(request.messages):
        raise errors.bad_request("Set exactly one of prompt and messages.", "prompt")
    if request.messages:
        body: dict[str, Any] = {"model": model, "messages": _messages(request.messages)}
        if request.HasField("add_generation_prompt"):
            body["add_generation_prompt"] = request.add_generation_prompt
        return list(convert.encode_chat(tokenizer, errors.validated(p.ChatCompletionRequest, body)))
    add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
    return list(tokenizer(request.prompt, add_special_tokens=add_special).input_ids)


def token_logprobs(entries: list[TokenLogprob] | None, texts: Callable[[int], str]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=e.token_id,
            token=texts(e.token_id),
            logprob=e.logprob,
            top_logprobs=[pb.TopLogprob(token_id=t, token=texts(t), logprob=lp) for t, lp in e.top],
        )
        for e in entries or ()
    ]


def prompt_logprobs(
    entries: list[TokenLogprob | None] | None, prompt_token_ids: list[int], texts: Callable[[int], str]
) -> list[pb.PromptLogprob]:
    """The engine's prompt logprobs (first entry None) as messages, one per prompt token."""
    out = []
    for token_id, e in zip(prompt_token_ids, entries or ()):
        if e is None:
            out.append(pb.PromptLogprob(token_id=token_id, token=texts(token_id)))
            continue
        out.append(pb.PromptLogprob(
            token_id=e.token_id, token=texts(e.token_id), logprob=e.logprob, rank=e.rank or 0,
            top_logprobs=[pb.TopLogprob(token_id=t, token=texts(t), logprob=lp) for t, lp in e.top],
        ))
    return out


def echo_text(request: pb.GenerateRequest, prompt_token_ids: list[int], tokenizer: Any) -> str:
    """What `echo` puts before the completion: the prompt as sent, or its ids decoded."""
    if not request.echo:
        return ""
    return request.prompt or tokenizer.decode(prompt_token_ids)


def set_stop(message: pb.GenerateResponse | pb.GenerateStreamResponse | pb.Choice, out: RequestOutput) -> None:
    """Copies a finished output's reason and stop string/token onto the message."""
    message.finish_reason = FINISH_REASONS.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED)  # type: ignore[assignment]
    if isinstance(out.stop_reason, str):
        message.stop_string = out.stop_reason
    elif isinstance(out.stop_reason, int):
        message.stop_token_id = out.stop_reason


def set_finish(message: pb.GenerateResponse | pb.GenerateStreamResponse, out: RequestOutput) -> None:
    """Copies a finished output's reason, stop string/token and usage onto the message."""
    set_stop(message, out)
    message.usage.CopyFrom(
        pb.Usage(
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens,
            cached_prompt_tokens=out.num_cached_tokens,
        )
    )


class Clock:
    """Latencies of one request at the ingress, as a Timing message."""

    def __init__(self) -> None:
        self.arrival = time.monotonic()
        self.arrival_unix = time.time()
        self.first_token_s = 0.0

    def observe(self, out: RequestOutput) -> None:
        if out.new_token_ids and not self.first_token_s:
            self.first_token_s = time.monotonic() - self.arrival

    def timing(self) -> pb.Timing:
        return pb.Timing(
            arrival_time=self.arrival_unix,
            time_to_first_token_s=self.first_token_s,
            elapsed_s=time.monotonic() - self.arrival,
        )


def replica_stats(stats: Mapping[str, Any]) -> pb.ReplicaStats:
    """A worker's `stats()` dict (engine + KV stats) as a ReplicaStats message."""
    queries = float(stats.get("prefix_cache_queries", 0) or 0)
    hits = float(stats.get("prefix_cache_hits", 0) or 0)
    return pb.ReplicaStats(
        replica_id=str(stats.get("replica_id", "")),
        free_blocks=int(stats.get("free_blocks", 0)),
        total_blocks=int(stats.get("total_blocks", 0)),
        block_size=int(stats.get("block_size", 0)),
        kv_usage=float(stats.get("kv_usage", 0.0)),
        num_running=int(stats.get("num_running", 0)),
        num_waiting=int(stats.get("num_waiting", 0)),
        num_waiting_prompt_tokens=int(stats.get("num_waiting_prompt_tokens", 0)),
        num_preemptions=int(stats.get("num_preemptions", 0)),
        num_generated_tokens=int(stats.get("num_generated_tokens", 0)),
        tokens_per_s=float(stats.get("tokens_per_s", 0.0)),
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        num_cached_blocks=int(stats.get("num_cached_blocks", 0)),
        pool=str(stats.get("pool", "")),
    )
