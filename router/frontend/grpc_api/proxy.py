"""The servicer function to give Serve's gRPC proxy, with a fix for cancelled streams.

    serve.start(grpc_options=gRPCOptions(port=..., grpc_servicer_functions=[GRPC_SERVICER]))

`GRPC_SERVICER` ("router.frontend.grpc_api.proxy.add_KVServeServicer_to_server") registers the KVServe
service exactly as the generated `protos.kvserve.v1.kvserve_pb2_grpc.add_KVServeServicer_to_server`
does; Serve's proxy imports and calls it in the proxy actor when its gRPC server starts.

The fix (Ray Serve 2.60, pinned by tests/integration/test_grpc_api.py). When a client
cancels a server-streaming call, grpc cancels the proxy's handler task wherever it is
awaiting. If that is inside Serve's response generator (waiting for the next message
from the ingress), Serve cancels the replica call and the engine aborts the request.
But if it is grpc's own `await context.write(...)` (the client stopped reading, so HTTP/2
flow control holds the write, and then cancelled), Serve's generators are left suspended
and are later finalized with GeneratorExit, which `gRPCProxy.send_request_to_replica`
swallows ("async generator ignored GeneratorExit") without cancelling the replica call:
the request ran on to max_tokens. Here each streaming handler of the KVServe service is
replaced by a coroutine handler (grpc's reader/writer API) that runs Serve's generator in
a task of its own, feeding an unbounded queue, and writes the messages itself: grpc's
cancellation then always lands in the coroutine, which cancels the task, and the task
only ever waits inside Serve's generator, so Serve's own cancel path runs. The coroutine
returns only after Serve's generator has finished (grpc frees the call when it returns,
and Serve's generator still reads it: a generator that outlives the call crashes the
proxy with a segfault in `context.peer()`). The queue holds what the client
has not read yet: at most one request's messages.

Undecodable requests. grpc answers a message its deserializer cannot parse (truncated,
wrong wire types, a string field that is not UTF-8) with INTERNAL ("Exception
deserializing request!"), as if the server had failed. Here the KVServe deserializers
return an `Undecodable` marker instead, and the handlers answer it INVALID_ARGUMENT in
the proxy, before anything reaches a replica.

Standard services: the same call registers grpc.health.v1 (router/frontend/grpc_api/health.py) and,
when configured, a TLS port (router/frontend/grpc_api/tls.py); Serve 2.60 adds server reflection.

Exposure: without API keys a local server answers loopback peers only; each KVServe
handler is then wrapped by router/frontend/grpc_api/exposure.py's loopback_guard.

Only the KVServe service's handlers are wrapped, and only when `server` is Serve's
gRPCGenericServer (it builds handlers through `service_handler_factory`); anywhere else
this is the plain generated function.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from router.frontend.grpc_api.exposure import loopback_guard, loopback_only
from router.frontend.grpc_api.health import start_health
from router.frontend.grpc_api.tls import add_tls_port

GRPC_SERVICER = "router.frontend.grpc_api.proxy.add_KVServeServicer_to_server"

_END = object()


class _Raised:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Undecodable:
    """What a KVServe deserializer returns for bytes that are not the request message."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    @property
    def details(self) -> str:
        return f"The request is not a valid protobuf message of the method's request type ({self.reason})."


def tolerant_deserializer(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    @functools.wraps(deserialize)
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # DecodeError, a bad UTF-8 string field, ...
            return Undecodable(type(e).__name__)

    return parse


def add_KVServeServicer_to_server(servicer: Any, server: Any) -> None:  # noqa: N802 (grpc's name)
    factory = getattr(server, "service_handler_factory", None)
    if factory is None or not callable(factory):
        pb_grpc.add_KVServeServicer_to_server(servicer, server)
        return
    _add_kvserve(servicer, server, factory)
    # The standard services next to KVServe, in the proxy itself (router/frontend/grpc_api/health.py,
    # router/frontend/grpc_api/tls.py); Serve adds server reflection after this returns.
    start_health(server)
    add_tls_port(server)


def _add_kvserve(servicer: Any, server: Any, factory: Callable[..., Any]) -> None:
    # Serve builds the handlers while the service is added: wrap the factory (and the
    # registration methods, for the deserializers) for this service only, then put the
    # originals back.
    add_generic = server.add_generic_rpc_handlers
    add_registered = getattr(server, "add_registered_method_handlers", None)

    def add_generic_tolerant(generic_rpc_handlers: Any) -> Any:
        for handler in generic_rpc_handlers:
            methods = getattr(handler, "_method_handlers", None)
            if isinstance(methods, dict):
                handler._method_handlers = _tolerant_handlers(methods)
        return add_generic(generic_rpc_handlers)

    def add_registered_tolerant(service_name: str, method_handlers: dict[str, Any]) -> Any:
        return add_registered(service_name, _tolerant_handlers(method_handlers))  # type: ignore[misc]

    server.service_handler_factory = _cancel_safe_factory(factory)
    server.add_generic_rpc_handlers = add_generic_tolerant
    if add_registered is not None:
        server.add_registered_method_handlers = add_registered_tolerant
    try:
        pb_grpc.add_KVServeServicer_to_server(servicer, server)
    finally:
        server.service_handler_factory = factory
        server.add_generic_rpc_handlers = add_generic
        if add_registered is not None:
            server.add_registered_method_handlers = add_registered


def _tolerant_handlers(method_handlers: dict[str, Any]) -> dict[str, Any]:
    return {
        name: h._replace(request_deserializer=tolerant_deserializer(h.request_deserializer))
        if hasattr(h, "_replace") and getattr(h, "request_deserializer", None) is not None
        else h
        for name, h in method_handlers.items()
    }


def _cancel_safe_factory(factory: Callable[..., Any]) -> Callable[..., Any]:
    # Read once, when the proxy's server is built (router/frontend/grpc_api/exposure.py).
    guard = loopback_guard if loopback_only() else (lambda handler: handler)

    def build(*args: Any, **kwargs: Any) -> Any:
        handler = factory(*args, **kwargs)
        if inspect.isasyncgenfunction(handler):
            return guard(cancel_safe_stream(handler))
        if inspect.iscoroutinefunction(handler):
            return guard(rejecting_undecodable(handler))
        return handler

    return build


def cancel_safe_stream(handler: Callable[..., AsyncIterator[Any]]) -> Callable[..., Awaitable[None]]:
    """`handler` (an async generator function taking (request, context)) as a coroutine
    handler that writes its messages with `context.write` itself.

    grpc then cancels the call inside this coroutine, whether it waits for the next
    message or in a write, and never drops it half way. The handler runs in a task of its
    own that only waits inside the handler, so cancelling that task always reaches
    Serve's cancel path; and this coroutine returns only after the handler has finished,
    because grpc releases the call (which Serve's handler still reads: peer, metadata)
    as soon as the coroutine returns.
    """

    async def stream(request: Any, context: Any) -> None:
        if isinstance(request, Undecodable):
            await _abort_undecodable(request, context)
            return
        queue: asyncio.Queue[Any] = asyncio.Queue()  # unbounded: the pump never waits on it

        async def pump() -> None:
            try:
                async for message in handler(request, context):
                    queue.put_nowait(message)
            except BaseException as e:  # noqa: BLE001 (handed to the writer)
                queue.put_nowait(_Raised(e))
                if isinstance(e, asyncio.CancelledError):
                    raise
            finally:
                queue.put_nowait(_END)

        task = asyncio.create_task(pump())
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    break
                if isinstance(item, _Raised):
                    raise item.error
                await context.write(item)
        finally:
            if not task.done():
                # The client cancelled (CancelledError in the get or the write above):
                # cancel Serve's handler where it waits, which cancels the replica call.
                task.cancel()
            await asyncio.wait([task])  # returns when it has finished; never raises

    return stream


def rejecting_undecodable(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """A unary handler that answers an Undecodable request INVALID_ARGUMENT itself."""

    async def unary(request: Any, context: Any) -> Any:
        if isinstance(request, Undecodable):
            await _abort_undecodable(request, context)
            return None
        return await handler(request, context)

    return unary


async def _abort_undecodable(request: Undecodable, context: Any) -> None:
    import grpc

    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
