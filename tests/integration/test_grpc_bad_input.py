"""Bad input on the gRPC API: undecodable and oversized messages, missing fields, absurd
values (hand-picked and fuzzed with hypothesis) -> the right status codes; the proxy and
the replicas keep serving and no KV block is left held.

Statuses: a message that does not decode as the request type is INVALID_ARGUMENT,
answered in the proxy (router/frontend/grpc_api/proxy.py; grpc alone says INTERNAL); one over the
receive limit (grpc's default 4 MiB) is RESOURCE_EXHAUSTED; everything that decodes but
is wrong is INVALID_ARGUMENT (NOT_FOUND for an unknown model).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import grpc
import hypothesis
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from protos.kvserve.v1 import kvserve_pb2 as pb  # noqa: E402
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc  # noqa: E402
from tests.integration import tiny_app  # noqa: E402

pytestmark = pytest.mark.integration

APP = "grpc-bad-input"
MODEL = "tiny-grpc-bad"
TIMEOUT_S = 60.0
FUZZ_CASES: dict[str, int] = {"grpc": 0}


@dataclass
class App:
    channel: Any
    stub: Any
    metadata: tuple[tuple[str, str], ...] = (("application", APP),)

    def call(self, method: str, request: Any) -> Any:
        result = getattr(self.stub, method)(request, metadata=self.metadata, timeout=TIMEOUT_S)
        return list(result) if method == "GenerateStream" else result

    def raw(self, method: str, payload: bytes) -> Any:
        call = self.channel.unary_unary(f"/kvserve.v1.KVServe/{method}")  # bytes in, bytes out
        return call(payload, metadata=self.metadata, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def app(serve_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    from ray import serve

    from tests.support.tiny_served_model import make_served_model

    model_dir: Path = make_served_model(tmp_path_factory.mktemp("grpc-bad") / "tiny")
    tiny_app.deploy(tiny_app.tiny_config(APP, model_dir, MODEL, {"max_queued_requests": 64}))
    channel = grpc.insecure_channel(f"127.0.0.1:{serve_cluster.grpc_port}")
    a = App(channel, pb_grpc.KVServeStub(channel))

    def routed() -> bool:  # the proxy learns of new applications asynchronously
        try:
            return [m.id for m in a.call("ListModels", pb.ListModelsRequest()).models] == [MODEL]
        except grpc.RpcError:
            return False

    tiny_app.wait_for(routed, "the gRPC proxy to route to the application")
    try:
        yield a
    finally:
        channel.close()
        serve.delete(APP)


def status_of(call: Callable[[], Any]) -> tuple[Any, str]:
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def request(**fields: Any) -> pb.GenerateRequest:
    base: dict[str, Any] = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    base.update(fields)
    return pb.GenerateRequest(**{k: v for k, v in base.items() if v is not None})


# -- bytes that are not the message ---------------------------------------------------------
@pytest.mark.parametrize("method", ["Generate", "GenerateStream", "Tokenize"])
@pytest.mark.parametrize(
    "payload",
    [
        b"\xff\xff\xff\xff",  # a truncated varint tag
        b"\x12\x05ab",  # field 2 (prompt) says 5 bytes, has 2
        b"\x12\x02\xc3\x28",  # field 2 (prompt), a string, with invalid UTF-8
        b"\x0b",  # a start-group wire type
    ],
)
def test_undecodable_messages(app: App, method: str, payload: bytes) -> None:
    code, details = status_of(lambda: app.raw(method, payload))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "not a valid protobuf message" in details


@pytest.mark.parametrize("method", ["Generate", "GenerateStream", "Tokenize"])
def test_oversized_message_is_resource_exhausted(app: App, method: str) -> None:
    # Serve's proxy takes messages up to 2 GiB; the ingress applies max_body_bytes (4 MiB).
    big = "x" * (5 * 1024 * 1024)
    message = pb.TokenizeRequest(prompt=big) if method == "Tokenize" else request(prompt=big)
    code, details = status_of(lambda: app.call(method, message))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert "larger than" in details


def test_unknown_fields_are_ignored(app: App) -> None:
    # Field 999 (varint): proto3 keeps it as unknown; the request is otherwise valid.
    payload = request(temperature=0.0).SerializeToString() + b"\xb8\x3e\x01"
    reply = pb.GenerateResponse.FromString(app.raw("Generate", payload))
    assert reply.usage.completion_tokens >= 1


# -- decodes, but wrong ------------------------------------------------------------------------
INVALID = [
    pytest.param({"model": None, "prompt": None, "max_tokens": None}, "exactly one", id="empty"),
    pytest.param({"prompt": None, "max_tokens": None}, "exactly one", id="no-input"),
    pytest.param({"prompt_token_ids": [1, 2]}, "exactly one", id="two-inputs"),
    pytest.param({"prompt": None, "prompt_token_ids": [2**32 - 1]}, "prompt token ids", id="token-id-max-uint32"),
    pytest.param({"max_tokens": 2**32 - 1}, "maximum context length", id="max-tokens-huge"),
    pytest.param({"temperature": float("nan")}, "temperature", id="temperature-nan"),
    pytest.param({"temperature": float("inf")}, "temperature", id="temperature-inf"),
    pytest.param({"top_p": 0.0}, "top_p", id="top-p-zero"),
    pytest.param({"top_k": -(2**31)}, "top_k", id="top-k-min-int32"),
    pytest.param({"min_p": -1.0}, "min_p", id="min-p"),
    pytest.param({"seed": 2**64 - 1}, "seed", id="seed-max-uint64"),
    pytest.param({"logprobs": 2**32 - 1}, "logprobs", id="logprobs-huge"),
    pytest.param({"stop": ["x"] * 17}, "stop", id="stop-too-many"),
    pytest.param({"stop": ["y" * 10_000]}, "stop", id="stop-too-long"),
    pytest.param({"stop": [""]}, "stop", id="stop-empty"),
    pytest.param({"stop_token_ids": list(range(1000))}, "stop_token_ids", id="stop-token-ids-many"),
    pytest.param({"repetition_penalty": 1e30}, "repetition_penalty", id="repetition-penalty"),
    pytest.param({"prompt": None, "messages": [pb.ChatMessage(role="wizard", content="x")]}, "role", id="role"),
    pytest.param({"prompt": "Hello " * 5000}, "maximum context length", id="prompt-too-long"),
]


@pytest.mark.parametrize(("fields", "fragment"), INVALID)
@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_invalid_argument(app: App, method: str, fields: dict[str, Any], fragment: str) -> None:
    code, details = status_of(lambda: app.call(method, request(**fields)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert fragment.lower() in details.lower(), details


def test_tokenize_missing_and_unknown(app: App) -> None:
    code, _ = status_of(lambda: app.call("Tokenize", pb.TokenizeRequest()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = status_of(lambda: app.call("Tokenize", pb.TokenizeRequest(model="other", prompt="hi")))
    assert code == grpc.StatusCode.NOT_FOUND


def test_huge_request_id_is_invalid(app: App) -> None:
    code, details = status_of(lambda: app.call("Generate", request(request_id="r" * 100_000)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details


# -- fuzzed values -----------------------------------------------------------------------------
floats = st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1.0, 2.0, -0.0]))
messages = st.lists(
    st.builds(pb.ChatMessage, role=st.sampled_from(["user", "system", "assistant", "tool", "x", ""]), content=st.text(max_size=30)),
    max_size=3,
)
fields = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.text(max_size=40),
        "prompt_token_ids": st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 400), max_size=8),
        "messages": messages,
        "max_tokens": st.integers(0, 2**32 - 1) | st.integers(1, 16),
        "temperature": floats,
        "top_p": floats,
        "top_k": st.integers(-(2**31), 2**31 - 1) | st.integers(-2, 50),
        "min_p": floats,
        "seed": st.integers(0, 2**64 - 1),
        "stop": st.lists(st.text(max_size=20), max_size=20),
        "stop_token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=70),
        "presence_penalty": floats,
        "frequency_penalty": floats,
        "repetition_penalty": floats,
        "logprobs": st.integers(0, 2**32 - 1) | st.integers(0, 25),
        "ignore_eos": st.booleans(),
        "min_tokens": st.integers(0, 2**32 - 1) | st.integers(0, 8),
        "include_stop_str_in_output": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "model": st.sampled_from([MODEL, "", "other"]),
        "request_id": st.text(max_size=20),
    },
)
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(fields=fields, method=st.sampled_from(["Generate", "GenerateStream"]))
def test_fuzzed_requests(app: App, fields: dict[str, Any], method: str) -> None:
    FUZZ_CASES["grpc"] += 1
    if isinstance(fields.get("max_tokens"), int) and 0 < fields["max_tokens"] <= 2**20:
        fields["max_tokens"] = min(fields["max_tokens"], 16)  # short generations on 2 cores
    if fields.get("request_id"):
        fields["request_id"] = f"{fields['request_id']}-{FUZZ_CASES['grpc']}"  # no accidental reuse
    code, details = status_of(lambda: app.call(method, pb.GenerateRequest(**fields)))
    assert code in ALLOWED, (code, details, fields)


def test_still_serving_and_no_blocks_leaked(app: App) -> None:
    tiny_app.wait_for(lambda: tiny_app.all_blocks_free(APP), "every KV block to be free")
    assert app.call("Health", pb.HealthRequest()).status == pb.HealthResponse.STATUS_SERVING
    reply = app.call("Generate", request(temperature=0.0, ignore_eos=True))
    assert reply.usage.completion_tokens == 4
    print(f"\nFUZZ grpc cases={FUZZ_CASES['grpc']}")
