"""The standard gRPC health service (grpc.health.v1) in Serve's gRPC proxy, following the
kvserve app's own verdict, so that Kubernetes gRPC probes and `grpc_health_probe` work.

    Serve's gRPC proxy (one per node)                        ingress replica
      grpc.health.v1.Health  <- HealthServicer (here, a passthrough service: it runs in
         Check / Watch            the proxy, never routed to a replica)
              ^ set(SERVING | NOT_SERVING) every HEALTH_POLL_S
      AppProbe ── loopback KVServe.Health ──────────────────> GrpcServicer.Health
                                                               NOT_SERVING when no worker
                                                               answers, or while draining

The verdict is the app's KVServe.Health, asked through the proxy exactly as a client
would (the same routing, the same drain): SERVING when it says so; NOT_SERVING when it
says not, or does not answer (no app yet, the app deleted, the proxy cannot reach it).
Both the server ("") and "kvserve.v1.KVServe" carry it. Serve's own server reflection
(gRPCOptions.enable_reflection, on by default in Ray 2.60) lists this service with KVServe.

With several Serve applications on the cluster, set KVSERVE_APP_NAME on the nodes (the
CLI does, for the app it deploys) so the probe names the app; otherwise it sends no
`application` metadata, which Serve routes to the only application.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from protos.kvserve.v1 import kvserve_pb2 as pb

logger = logging.getLogger(__name__)

KVSERVE_SERVICE = "kvserve.v1.KVServe"
APP_NAME_ENV = "KVSERVE_APP_NAME"
HEALTH_POLL_S = 1.0  # how stale the health service's verdict may be
PROBE_TIMEOUT_S = 5.0


def _health_modules() -> tuple[Any, Any, Any]:
    try:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    except ImportError as e:
        raise ImportError(
            "kvserve's gRPC health service needs grpcio-health-checking: pip install 'grpcio-health-checking>=1.85.1,<1.86'"
        ) from e
    return health, health_pb2, health_pb2_grpc


def add_health_servicer(server: Any) -> Any:
    """Registers grpc.health.v1.Health on `server` (as a passthrough service on Serve's
    gRPCGenericServer, so that it answers in the proxy), NOT_SERVING until the first probe
    says otherwise. Returns the servicer (its `set` changes the verdict)."""
    health, health_pb2, health_pb2_grpc = _health_modules()
    servicer = health.aio.HealthServicer()
    # aio's HealthServicer starts with "" SERVING; nothing is known yet.
    servicer._server_status[""] = health_pb2.HealthCheckResponse.NOT_SERVING
    servicer._server_status[KVSERVE_SERVICE] = health_pb2.HealthCheckResponse.NOT_SERVING
    add_passthrough = getattr(server, "add_passthrough_service", None)
    if callable(add_passthrough):
        add_passthrough(health.SERVICE_NAME)  # before its handlers are added (Serve's rule)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


class AppProbe:
    """Asks the app for its KVServe.Health verdict through the local proxy, and sets it on
    the health servicer; runs for the proxy's lifetime."""

    def __init__(self, servicer: Any, port: int | None = None, app_name: str | None = None) -> None:
        self.servicer = servicer
        self._port = port
        self._app_name = app_name if app_name is not None else os.environ.get(APP_NAME_ENV)
        self.last_message = "not probed yet"

    async def port(self) -> int:
        if self._port is None:
            from router.serve_internals import grpc_proxy_port

            self._port = await grpc_proxy_port()
        return self._port

    async def probe(self) -> bool:
        import grpc

        from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc

        metadata = (("application", self._app_name),) if self._app_name else ()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{await self.port()}") as channel:
                reply = await pb_grpc.KVServeStub(channel).Health(pb.HealthRequest(), metadata=metadata, timeout=PROBE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 (RpcError: no app, unreachable; the controller gone, ...)
            self.last_message = f"{type(e).__name__}: {getattr(e, 'details', lambda: '')() or e}"
            return False
        self.last_message = reply.message
        return reply.status == pb.HealthResponse.STATUS_SERVING

    async def update(self) -> bool:
        _, health_pb2, _ = _health_modules()
        serving = await self.probe()
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", KVSERVE_SERVICE):
            await self.servicer.set(service, status)
        return serving

    async def run(self, interval_s: float = HEALTH_POLL_S) -> None:
        while True:
            try:
                await self.update()
            except Exception:  # never let the probe loop die: the verdict would freeze
                logger.exception("gRPC health probe failed")
            await asyncio.sleep(interval_s)  # a polling period, not a synchronisation


_probes: list[asyncio.Task[None]] = []  # keeps the probe tasks alive (the loop holds weak refs)


def start_health(server: Any) -> Any:
    """The health servicer on `server`, and its probe loop on the running event loop (Serve
    calls the servicer functions from its async start_grpc_server). Outside an event
    loop (a sync grpc server) the servicer is registered and set by the caller."""
    servicer = add_health_servicer(server)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return servicer
    _probes.append(loop.create_task(AppProbe(servicer).run()))
    return servicer
