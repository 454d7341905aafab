"""A small typed Python client of kvserve's gRPC API (protos/kvserve/v1/kvserve.proto).

    from router.frontend.grpc_api.client import KVServeClient

    with KVServeClient("127.0.0.1:9000") as client:
        print(client.generate("Hello", max_tokens=16, temperature=0).text)
        for message in client.generate_stream("Hello", max_tokens=16):
            print(message.text, end="", flush=True)
        client.tokenize("Hello").token_ids

Failures raise KVServeError with the gRPC status code and the server's message.
`application` names the Serve application (metadata "application"), needed only when
the cluster runs more than one. `api_key` is sent as "authorization: Bearer <key>".
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypedDict, Unpack

import grpc

from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc


class SamplingOptions(TypedDict, total=False):
    """GenerateRequest's sampling fields (see the .proto for each one's meaning)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int
    ignore_eos: bool
    min_tokens: int
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    add_generation_prompt: bool
    logit_bias: Mapping[int, float]
    n: int
    cache_salt: str  # vLLM's: the request's prefix-cache partition
    priority: int  # vLLM's: lower first


Message = tuple[str, str] | dict[str, str]  # (role, content) or {"role", "content", "name"?}


class KVServeError(Exception):
    """A failed call: `code` is the gRPC status (INVALID_ARGUMENT, NOT_FOUND, ...)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> KVServeError:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(code, details or "")


class GenerationStream:
    """An iterator of GenerateStreamResponse messages; `cancel()` (or leaving a `with`
    block early) cancels the call, which aborts the request on the server."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Iterator[pb.GenerateStreamResponse]:
        return self

    def __next__(self) -> pb.GenerateStreamResponse:
        try:
            return next(self._call)
        except grpc.RpcError as e:
            raise KVServeError.from_rpc_error(e) from None

    def cancel(self) -> None:
        self._call.cancel()

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.cancel()  # a no-op when the stream has finished


class KVServeClient:
    def __init__(
        self,
        target: str,
        api_key: str | None = None,
        *,
        application: str | None = None,
        timeout: float | None = None,
        channel: grpc.Channel | None = None,
    ) -> None:
        """`target` is "host:port" of Serve's gRPC proxy; `timeout` (seconds) is the
        default deadline of every call (None: no deadline)."""
        self.target = target
        self.timeout = timeout
        self._own_channel = channel is None
        self._channel = channel if channel is not None else grpc.insecure_channel(target)
        self._stub = pb_grpc.KVServeStub(self._channel)
        metadata: list[tuple[str, str]] = []
        if application:
            metadata.append(("application", application))
        if api_key:
            metadata.append(("authorization", f"Bearer {api_key}"))
        self._metadata = tuple(metadata)

    # -- generation ------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Message] | None = None,
        model: str = "",
        request_id: str = "",
        timeout: float | None = None,
        **options: Unpack[SamplingOptions],
    ) -> pb.GenerateResponse:
        """The whole completion of a text prompt, token ids, or chat `messages`."""
        request = build_generate_request(prompt, messages=messages, model=model, request_id=request_id, **options)
        return self._call(self._stub.Generate, request, timeout)

    def generate_stream(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Message] | None = None,
        model: str = "",
        request_id: str = "",
        timeout: float | None = None,
        **options: Unpack[SamplingOptions],
    ) -> GenerationStream:
        """The completion as it is generated; see GenerationStream."""
        request = build_generate_request(prompt, messages=messages, model=model, request_id=request_id, **options)
        call = self._stub.GenerateStream(request, timeout=self._timeout(timeout), metadata=self._metadata)
        return GenerationStream(call)

    # -- the rest --------------------------------------------------------------------------
    def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        model: str = "",
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool | None = None,
        return_token_strings: bool = False,
        timeout: float | None = None,
    ) -> pb.TokenizeResponse:
        request = pb.TokenizeRequest(
            model=model,
            prompt=prompt or "",
            messages=_chat_messages(messages or ()),
            return_token_strings=return_token_strings,
        )
        if add_special_tokens is not None:
            request.add_special_tokens = add_special_tokens
        if add_generation_prompt is not None:
            request.add_generation_prompt = add_generation_prompt
        return self._call(self._stub.Tokenize, request, timeout)

    def list_models(self, timeout: float | None = None) -> list[pb.ModelInfo]:
        return list(self._call(self._stub.ListModels, pb.ListModelsRequest(), timeout).models)

    def health(self, timeout: float | None = None) -> pb.HealthResponse:
        return self._call(self._stub.Health, pb.HealthRequest(), timeout)

    def is_serving(self, timeout: float | None = None) -> bool:
        return self.health(timeout).status == pb.HealthResponse.STATUS_SERVING

    def stats(self, timeout: float | None = None) -> pb.StatsResponse:
        return self._call(self._stub.Stats, pb.StatsRequest(), timeout)

    # -- plumbing --------------------------------------------------------------------------
    def _timeout(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout

    def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return method(request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise KVServeError.from_rpc_error(e) from None

    def close(self) -> None:
        if self._own_channel:
            self._channel.close()

    def __enter__(self) -> KVServeClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _chat_messages(messages: Sequence[Message]) -> list[pb.ChatMessage]:
    out = []
    for m in messages:
        if isinstance(m, dict):
            out.append(pb.ChatMessage(role=m["role"], content=m.get("content", ""), name=m.get("name", "")))
        else:
            role, content = m
            out.append(pb.ChatMessage(role=role, content=content))
    return out


def build_generate_request(
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Sequence[Message] | None = None,
    model: str = "",
    request_id: str = "",
    **options: Unpack[SamplingOptions],
) -> pb.GenerateRequest:
    """A GenerateRequest from Python values (a str prompt is text, a sequence of ints is
    token ids); unknown option names raise TypeError."""
    request = pb.GenerateRequest(model=model, request_id=request_id, messages=_chat_messages(messages or ()))
    if isinstance(prompt, str):
        request.prompt = prompt
    elif prompt is not None:
        request.prompt_token_ids.extend(int(t) for t in prompt)
    fields = pb.GenerateRequest.DESCRIPTOR.fields_by_name
    for name, value in options.items():
        if name not in SamplingOptions.__annotations__ or name not in fields:
            raise TypeError(f"unknown generation option {name!r}")
        if value is None:
            continue
        if name == "logit_bias":
            request.logit_bias.update({int(t): float(b) for t, b in value.items()})  # type: ignore[union-attr]
        elif name in ("stop", "stop_token_ids"):
            getattr(request, name).extend([value] if isinstance(value, str) else value)  # type: ignore[list-item]
        else:
            setattr(request, name, value)
    return request
