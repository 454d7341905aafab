"""router.frontend.grpc_api.proxy without Ray: the cancel-safe wrapper of Serve's streaming handlers."""
from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from typing import Any
from unittest.mock import Mock

import pytest

from router.frontend.grpc_api import proxy


class Handler:
    """Stands in for Serve's unary_stream handler: yields `n` messages, then waits (for
    the next message from a replica) until cancelled."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.cancelled = asyncio.Event()
        self.finished = False

    async def __call__(self, request: Any, context: Any) -> AsyncIterator[bytes]:
        try:
            for i in range(self.n):
                yield f"{request}-{i}".encode()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        finally:
            self.finished = True


class FakeContext:
    """grpc's ServicerContext as the coroutine handler uses it: `write`, which can be held
    (HTTP/2 flow control) to cancel the call inside it."""

    def __init__(self, hold_after: int | None = None) -> None:
        self.written: list[bytes] = []
        self.hold_after = hold_after
        self.holding = asyncio.Event()

    async def write(self, message: bytes) -> None:
        if self.hold_after is not None and len(self.written) >= self.hold_after:
            self.holding.set()
            await asyncio.Event().wait()
        self.written.append(message)


async def test_messages_pass_through_in_order() -> None:
    async def finite(request: Any, context: Any) -> AsyncIterator[bytes]:
        for i in range(3):
            yield bytes([i])

    context = FakeContext()
    stream = proxy.cancel_safe_stream(finite)
    assert inspect.iscoroutinefunction(stream)  # grpc's reader/writer API
    await stream("r", context)
    assert context.written == [b"\x00", b"\x01", b"\x02"]


async def test_errors_pass_through() -> None:
    async def failing(request: Any, context: Any) -> AsyncIterator[bytes]:
        yield b"a"
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await proxy.cancel_safe_stream(failing)("r", FakeContext())


@pytest.mark.parametrize("hold_after", [None, 1], ids=["waiting-for-a-message", "blocked-in-a-write"])
async def test_a_cancelled_call_cancels_the_handler_before_returning(hold_after: int | None) -> None:
    """grpc cancels the call's task wherever it waits: for the handler's next message, or
    in a write the client does not read. Either way the handler is cancelled inside its own
    await, and has finished before the call's coroutine returns (grpc frees the call then)."""
    handler = Handler(3)
    context = FakeContext(hold_after)
    task = asyncio.create_task(proxy.cancel_safe_stream(handler)("r", context))
    if hold_after is None:
        while len(context.written) < 3:
            await asyncio.sleep(0)
    else:
        await context.holding.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert handler.cancelled.is_set() and handler.finished


class FakeServeServer:
    """The parts of Serve's gRPCGenericServer the generated add function meets."""

    def __init__(self) -> None:
        self.handlers: dict[str, dict[str, Any]] = {}
        self.passthrough: dict[str, Any] = {}
        self.passthrough_services: set[str] = set()
        self.service_handler_factory = self._factory

    def add_passthrough_service(self, service_name: str) -> None:
        self.passthrough_services.add(service_name)

    def _factory(self, service_method: str, streaming_type: str) -> Any:
        async def stream(request: Any, context: Any) -> AsyncIterator[bytes]:
            yield b""

        async def unary(request: Any, context: Any) -> bytes:
            return b""

        return stream if streaming_type == "stream" else unary

    def add_generic_rpc_handlers(self, generic_handlers: Any) -> None:
        for name, handler in generic_handlers[0]._method_handlers.items():
            if name.split("/")[1] in self.passthrough_services:  # Serve registers these unmodified
                self.passthrough[name] = handler
                continue
            self.handlers[name] = {
                kind: self.service_handler_factory(service_method=name, streaming_type=kind) for kind in ("stream", "unary")
            }

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict[str, Any]) -> None:
        pass


def test_only_the_kvserve_streaming_handlers_are_wrapped() -> None:
    server = FakeServeServer()
    original = server.service_handler_factory
    proxy.add_KVServeServicer_to_server(Mock(), server)
    assert server.service_handler_factory == original  # put back for other services
    assert "/kvserve.v1.KVServe/GenerateStream" in server.handlers
    for built in server.handlers.values():
        assert "cancel_safe_stream" in built["stream"].__qualname__
        assert inspect.iscoroutinefunction(built["stream"])
        assert "cancel_safe_stream" not in built["unary"].__qualname__
    # grpc.health.v1 answers in the proxy itself, next to KVServe (router/frontend/grpc_api/health.py).
    assert {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"} <= set(server.passthrough)


def test_a_plain_grpc_server_gets_the_generated_registration() -> None:
    """A server that is not Serve's (no service_handler_factory) gets exactly the generated
    registration: the service answers over loopback, and an undecodable request gets
    grpc's own INTERNAL (no tolerant deserializer was put in)."""
    import grpc
    from concurrent import futures

    from protos.kvserve.v1 import kvserve_pb2 as pb
    from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc

    class Servicer(pb_grpc.KVServeServicer):
        def Tokenize(self, request: Any, context: Any) -> Any:  # noqa: N802 (grpc's name)
            return pb.TokenizeResponse(token_ids=[7, 8], count=2)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    proxy.add_KVServeServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = pb_grpc.KVServeStub(channel).Tokenize(pb.TokenizeRequest(prompt="hi"), timeout=30)
            assert list(reply.token_ids) == [7, 8] and reply.count == 2
            raw = channel.unary_unary("/kvserve.v1.KVServe/Tokenize")  # bytes in, bytes out
            with pytest.raises(grpc.RpcError) as info:
                raw(b"\xff\xff\xff\xff", timeout=30)
            assert info.value.code() == grpc.StatusCode.INTERNAL
    finally:
        server.stop(None)


def test_undecodable_requests_become_a_marker_and_invalid_argument() -> None:
    from protos.kvserve.v1 import kvserve_pb2 as pb

    parse = proxy.tolerant_deserializer(pb.GenerateRequest.FromString)
    assert parse(pb.GenerateRequest(prompt="hi").SerializeToString()).prompt == "hi"
    for garbage in (b"\xff\xff\xff\xff", b"\x12\x05ab", b"\x12\x02\xc3\x28"):
        marker = parse(garbage)
        assert isinstance(marker, proxy.Undecodable) and "not a valid protobuf message" in marker.details

    aborted: list[Any] = []

    class Context:
        async def abort(self, code: Any, details: str) -> None:
            aborted.append((code, details))

    async def handler(request: Any, context: Any) -> str:
        return "handled"

    import grpc

    guarded = proxy.rejecting_undecodable(handler)
    assert asyncio.run(guarded(pb.GenerateRequest(), Context())) == "handled"
    asyncio.run(guarded(proxy.Undecodable("DecodeError"), Context()))
    assert aborted and aborted[0][0] == grpc.StatusCode.INVALID_ARGUMENT


def test_the_serve_server_gets_tolerant_deserializers() -> None:
    seen: dict[str, Any] = {}

    class Server(FakeServeServer):
        def add_registered_method_handlers(self, service_name: str, method_handlers: dict[str, Any]) -> None:
            seen.update(method_handlers)

    server = Server()
    proxy.add_KVServeServicer_to_server(Mock(), server)
    assert isinstance(seen["Generate"].request_deserializer(b"\xff\xff"), proxy.Undecodable)
    assert server.add_registered_method_handlers.__name__ == "add_registered_method_handlers"  # put back
