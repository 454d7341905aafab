"""The servicer function to give Serve's gRPC proxy, with a fix for cancelled streams.

    serve.start(grpc_options=gRPCOptions(port=..., grpc_servicer_functions=[GRPC_SERVICER]))

`GRPC_SERVICER` ("router.grpc_proxy.add_KVServeServicer_to_server") registers the KVServe
service exactly as the generated `protos.kvserve.v1.kvserve_pb2_grpc.add_KVServeServicer_to_server`
does; Serve's proxy imports and calls it in the proxy actor when its gRPC server starts.

The fix (Ray Serve 2.60, measured in tests/integration/test_grpc_api.py). When a client
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
and Serve's generator still reads it: a first version that let it outlive the call
crashed the proxy with a segfault in `context.peer()`). The queue holds what the client
has not read yet: at most one request's messages.

Only the KVServe service's handlers are wrapped, and only when `server` is Serve's
gRPCGenericServer (it builds handlers through `service_handler_factory`); anywhere else
this is the plain generated function.
"""
from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc

GRPC_SERVICER = "router.grpc_proxy.add_KVServeServicer_to_server"

_END = object()


class _Raised:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def add_KVServeServicer_to_server(servicer: Any, server: Any) -> None:  # noqa: N802 (grpc's name)
    factory = getattr(server, "service_handler_factory", None)
    if factory is None or not callable(factory):
        pb_grpc.add_KVServeServicer_to_server(servicer, server)
        return
    # Serve builds the handlers while the service is added: wrap the factory for this
    # service only, then put the original back.
    server.service_handler_factory = _cancel_safe_factory(factory)
    try:
        pb_grpc.add_KVServeServicer_to_server(servicer, server)
    finally:
        server.service_handler_factory = factory


def _cancel_safe_factory(factory: Callable[..., Any]) -> Callable[..., Any]:
    def build(*args: Any, **kwargs: Any) -> Any:
        handler = factory(*args, **kwargs)
        return cancel_safe_stream(handler) if inspect.isasyncgenfunction(handler) else handler

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
