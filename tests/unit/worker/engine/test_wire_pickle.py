"""What a worker replica sends an ingress crosses gRPC between replicas pickled with the C
pickler (router/serve_internals.py `process_transport`): requests, output lists and the
errors a worker raises must all come back equal, with their types, from plain pickle."""
from __future__ import annotations

import pickle

import pytest

from kv.transfer import KVSourceLostError, KVTransferError
from worker.api import (
    GenerateRequest,
    KVImportError,
    LoRAAdapterError,
    LoRANotFoundError,
    MissingDependencyError,
    ReplicaDrainingError,
    RequestError,
    RequestOutput,
    SamplingParams,
    SamplingParamsError,
    TokenLogprob,
)
from worker.engine.async_engine import EngineDeadError


def _round_trip(obj: object) -> object:
    return pickle.loads(pickle.dumps(obj, protocol=5))


def test_a_request_with_every_field_set_round_trips() -> None:
    request = GenerateRequest(
        "r1", list(range(40)), SamplingParams(max_tokens=9, temperature=0.5, stop=("\n",), seed=3, priority=2),
        num_resumed_tokens=4, trace_context={"traceparent": "00-ab-cd-01"}, session_id="s",
        output_stream="hub", stream=False, lora_name="sql", lora_path="/adapters/sql")
    assert _round_trip(request) == request


def test_a_steps_output_list_round_trips() -> None:
    outputs = [
        RequestOutput("a", [5, 6], " x", logprobs=[TokenLogprob(5, -0.1, ((5, -0.1), (7, -2.0)))],
                      prompt_logprobs=[None, TokenLogprob(3, -1.0, (), rank=4)], num_prompt_tokens=2, num_output_tokens=2),
        RequestOutput("b", [], "", finished=True, finish_reason="error", error="boom", extra={"k": 1}),
    ]
    assert _round_trip(outputs) == outputs


@pytest.mark.parametrize("error", [
    LoRANotFoundError("sql", ["b", "a"]),
    LoRAAdapterError("bad rank"),
    KVImportError("layout"),
    RequestError("too long"),
    SamplingParamsError("top_p"),
    ReplicaDrainingError("draining"),
    EngineDeadError("stopped"),
    MissingDependencyError("vllm-flash-attn"),
    KVSourceLostError("gone"),
    KVTransferError("bad"),
], ids=lambda e: type(e).__name__)
def test_every_error_a_worker_raises_round_trips(error: Exception) -> None:
    back = _round_trip(error)
    assert type(back) is type(error)
    assert str(back) == str(error)
    assert back.__dict__ == error.__dict__
