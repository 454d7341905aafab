"""Every private Ray Serve attribute kvserve uses, in one adapter (written against Ray 2.60).

Each function below is the only place its private attribute is touched, and says which
public API it stands in for (or that Serve has none). `PRIVATE_APIS` lists them all with
a check that the attribute still exists; tests/unit/router/test_serve_internals.py runs those
checks, so a Ray upgrade that moves one fails there, naming the Ray version and the
attribute, instead of somewhere deep in a routing decision.

Also private, but not an attribute read here: router/frontend/grpc_api/proxy.py wraps the handler
factory of Serve's gRPC server (`gRPCGenericServer.service_handler_factory`); it is in
`PRIVATE_APIS` too.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

logger = logging.getLogger(__name__)


# -- the request context --------------------------------------------------------------------
def use_child_request_id(suffix: int | str) -> None:
    """Give the handle calls this asyncio task makes from now on their own Serve internal
    request id: `<the request's id>-<suffix>`.

    Why: Serve 2.60 gives every handle call made while serving one request that request's
    internal id, and its request router indexes pending calls by that id: a second
    concurrent call to the same deployment is then never fulfilled (with a custom router it
    hung every n=2 request). A child id per engine request fixes that, and lets routers
    that key their bookkeeping by the id (the KV-headroom ledger) tell them apart. Serve
    then no longer links these calls to the HTTP request for cancellation; the caller
    (router/frontend/generation.py) cancels them itself.

    Public API it stands in for: none (Serve has no option to set a handle call's request
    id). Private: `ray.serve.context._serve_request_context` (a ContextVar),
    `_get_serve_request_context()` and the `_RequestContext._internal_request_id` field.
    Only this task's context changes (each asyncio task has its own copy).
    """
    from ray.serve import context as serve_context

    current = serve_context._get_serve_request_context()
    parent = current._internal_request_id or uuid.uuid4().hex
    serve_context._serve_request_context.set(replace(current, _internal_request_id=f"{parent}-{suffix}"))


# -- the request router's base class ----------------------------------------------------------
def cached_queue_len(request_router: Any, replica_id: Any) -> int | None:
    """The replica's queue length as Serve last probed it, when the deployment uses Serve's
    queue-length cache; else None.

    Public API: `RequestRouter.replica_queue_len_cache` (the cache itself). Private:
    `_use_replica_queue_len_cache` (whether Serve keeps that cache up to date: without it
    the entries are only what the last probe left, so they are not used).
    """
    if not request_router._use_replica_queue_len_cache:
        return None
    return request_router.replica_queue_len_cache.get(replica_id)


def router_now_s(request_router: Any) -> float:
    """The router's clock (time.time unless Serve injected another, as its tests do).

    Public API it stands in for: none. Private: `RequestRouter._get_curr_time_s`.
    """
    return float(request_router._get_curr_time_s())


async def fetch_routing_stats(replica: Any) -> dict[str, Any]:
    """The replica's routing stats taken now, for a router that starts before the controller
    polled that replica (warm start: its prefix hashes before the first decision).

    Public API it stands in for: none (`RunningReplica.routing_stats` is only the
    controller's last poll). Private: `RunningReplica._actor_handle` and the replica
    actor's `record_routing_stats` method (the one the controller calls; it calls the
    deployment's own `record_routing_stats`).
    """
    return dict(await replica._actor_handle.record_routing_stats.remote() or {})


# -- a handle's transport ----------------------------------------------------------------------
def process_transport(handle: Any, by_reference: bool | None = None) -> Any:
    """`handle` with this process's Serve transport between deployments, and plain pickle
    for what crosses it.

    Why: a handle carries its transport (`_by_reference`) in its options, fixed where it
    was made. kvserve makes the worker handles in the driver, which keeps Serve's defaults
    (cluster/serve_env.py), so without this every call from an ingress replica took Ray's
    actor-call path even where the replica runs Serve's throughput-optimized mode, whose
    default is gRPC straight between replicas. `by_reference=True` keeps the actor path
    for calls whose arguments or results hold Ray ObjectRefs (a disaggregated request's KV
    handle): only that path tracks their ownership. Plain pickle instead of cloudpickle:
    every type kvserve sends is importable, and the C pickler is the faster one.

    Public API it stands in for: `DeploymentHandle.options(_by_reference=...)` is public in
    its signature; Serve's per-process default is not. Private:
    `ray.serve._private.constants.RAY_SERVE_USE_GRPC_BY_DEFAULT`.
    """
    from ray.serve._private import constants

    if by_reference is None:
        by_reference = not constants.RAY_SERVE_USE_GRPC_BY_DEFAULT
    if by_reference:
        return handle.options(_by_reference=True)
    return handle.options(_by_reference=False, request_serialization="pickle", response_serialization="pickle")


# -- a handle call's progress ----------------------------------------------------------------
def when_sent(response: Any, callback: Callable[[], None]) -> None:
    """Call `callback` (on the caller's event loop) once Serve has routed the handle call
    `response` (a DeploymentResponse or DeploymentResponseGenerator) and sent it to its
    replica, or failed to. A response without that future (a test double, a Ray that
    moved it) never calls back: callers bound their wait another way.

    Public API it stands in for: none (a response only says when its first result is
    back, a round trip to the replica later). Private: `_replica_result_future`, the task
    (or, with the router on its own loop, the concurrent future) that resolves to the
    ReplicaResult once the request is on its way to the replica.
    """
    future = getattr(response, "_replica_result_future", None)
    if future is None or not callable(getattr(future, "add_done_callback", None)):
        return
    if isinstance(future, asyncio.Future):
        future.add_done_callback(lambda _: callback())
        return
    loop = asyncio.get_running_loop()
    future.add_done_callback(lambda _: loop.call_soon_threadsafe(callback))


# -- a handle's request router ----------------------------------------------------------------
def request_router_of(handle: Any) -> Any:
    """The RequestRouter instance behind a DeploymentHandle in this process (None until the
    handle has routed a request), for benchmarks and tests that read its counters.

    Public API it stands in for: none. Private: `DeploymentHandle._router` (the
    SingletonThreadRouter), its `_asyncio_router` (AsyncioRouter) and that one's public
    `request_router` property.
    """
    router = getattr(handle, "_router", None)
    if router is None:
        return None
    return router._asyncio_router.request_router


def initialized_request_router_of(handle: Any) -> Any:
    """The RequestRouter behind a DeploymentHandle in this process once Serve's router
    thread has created it (when the first replica set arrived), else None. Unlike
    `request_router_of` it never creates the router itself, so it is safe to call from
    another thread than the router's (the ingress's admission control reads its reports).

    Public API it stands in for: none. Private: `DeploymentHandle._router`, its
    `_asyncio_router` and that one's `_request_router` attribute.
    """
    router = getattr(handle, "_router", None)
    if router is None:
        return None
    return getattr(router._asyncio_router, "_request_router", None)


def known_replica_count(handle: Any) -> int | None:
    """How many replicas the handle's router in this process knows of (its last replica set
    from the controller), or None before it has one.

    Public API it stands in for: none (serve.status() asks the controller, a blocking call).
    Private: what initialized_request_router_of reads, and the router's `curr_replicas`.
    """
    router = initialized_request_router_of(handle)
    replicas = getattr(router, "curr_replicas", None)
    return None if replicas is None else len(replicas)


# -- the controller's gRPC options --------------------------------------------------------------
def grpc_servicer_functions() -> list[str]:
    """The servicer functions ("module.function") the running Serve instance's gRPC proxy
    was started with, for tests that need router/frontend/grpc_api/proxy.py's fix registered. Blocks
    (ray.get): call it from synchronous code only.

    Public API it stands in for: none (serve.status() does not show the gRPC options).
    Private: `ray.serve.context._get_global_client()`, its `_controller` actor handle and
    that actor's `get_grpc_config` method.
    """
    import ray
    from ray.serve.context import _get_global_client

    config = ray.get(_get_global_client()._controller.get_grpc_config.remote())
    return list(config.grpc_servicer_functions)


async def grpc_proxy_port() -> int:
    """The port Serve's gRPC proxies listen on, read from the controller (for the health
    service in the proxy, router/frontend/grpc_api/health.py, which probes the app through it).

    Public API it stands in for: none. Private: the same controller call as
    `grpc_servicer_functions`. (A worker node's proxy may listen on
    RAY_SERVE_WORKER_PROXY_GRPC_PORT instead; kvserve does not set it.)
    """
    from ray.serve.context import _get_global_client

    config = await _get_global_client()._controller.get_grpc_config.remote()
    return int(config.port)


# -- the controller's view of every application -----------------------------------------------------
def serve_instance_details() -> dict[str, Any]:
    """Serve's ServeInstanceDetails as a dict: every application, its deployments (status,
    target_num_replicas, deployment_config, autoscaling_detail) and their replicas (state,
    node_id, node_ip, pid), for `kvserve status` (cluster/status.py). Blocks (ray.get): call
    it from synchronous code only. Raises when no Serve instance runs on the cluster.

    Public API it stands in for: the dashboard's REST GET /api/serve/applications/ (the same
    schema, but only with the dashboard running; kvserve serve starts it only on request);
    serve.status() has neither the replicas' nodes nor the target counts. Private:
    `ray.serve.context._get_global_client()` and its `get_serve_details()`.
    """
    from ray.serve.context import _get_global_client

    return dict(_get_global_client().get_serve_details())


# -- the registry the unit test checks ------------------------------------------------------------
@dataclass(frozen=True)
class PrivateApi:
    name: str  # where it lives in Ray, as in the docstrings above
    used_by: str
    exists: Callable[[], bool]


def _context_api() -> bool:
    from ray.serve import context as serve_context

    context_fields = {f.name for f in fields(serve_context._RequestContext)}
    return (
        callable(getattr(serve_context, "_get_serve_request_context", None))
        and hasattr(serve_context._serve_request_context, "set")
        and "_internal_request_id" in context_fields
    )


def _router_instance_attribute(name: str) -> Callable[[], bool]:
    def exists() -> bool:
        from ray.serve._private.common import DeploymentHandleSource, DeploymentID
        from ray.serve.request_router import RequestRouter

        class Probe(RequestRouter):
            async def choose_replicas(self, candidate_replicas: Any, pending_request: Any = None) -> Any:
                return [candidate_replicas]

        probe = Probe(deployment_id=DeploymentID(name="probe", app_name="probe"), handle_source=DeploymentHandleSource.UNKNOWN)
        return hasattr(probe, name)

    return exists


def _handle_router() -> bool:
    from ray.serve._private.router import AsyncioRouter, SingletonThreadRouter
    from ray.serve.handle import DeploymentHandle

    handle_init = inspect.getsource(DeploymentHandle.__mro__[1].__init__)  # _DeploymentHandleBase
    return (
        "self._router" in handle_init
        and "self._asyncio_router" in inspect.getsource(SingletonThreadRouter.__init__)
        and isinstance(inspect.getattr_static(AsyncioRouter, "request_router"), property)
    )


def _handle_router_no_init() -> bool:
    from ray.serve._private.router import AsyncioRouter

    return _handle_router() and "self._request_router" in inspect.getsource(AsyncioRouter.__init__)


def _response_sent_future() -> bool:
    from ray.serve.handle import _DeploymentResponseBase

    return "self._replica_result_future" in inspect.getsource(_DeploymentResponseBase.__init__)


def _replica_stats_on_demand() -> bool:
    from ray.serve._private.replica import ReplicaActor
    from ray.serve._private.request_router.replica_wrapper import RunningReplica

    return "self._actor_handle" in inspect.getsource(RunningReplica.__init__) and callable(
        getattr(ReplicaActor, "record_routing_stats", None))


def _grpc_handler_factory() -> bool:
    from ray.serve._private import grpc_util

    return "service_handler_factory" in inspect.getsource(grpc_util.gRPCGenericServer)


def _controller_grpc_config() -> bool:
    from ray.serve import context as serve_context
    from ray.serve._private.client import ServeControllerClient
    from ray.serve._private.controller import ServeController

    return (
        callable(getattr(serve_context, "_get_global_client", None))
        and "self._controller" in inspect.getsource(ServeControllerClient.__init__)
        and callable(getattr(ServeController, "get_grpc_config", None))
    )


def _grpc_default() -> bool:
    from ray.serve._private import constants

    return isinstance(getattr(constants, "RAY_SERVE_USE_GRPC_BY_DEFAULT", None), bool)


def _serve_details() -> bool:
    from ray.serve import context as serve_context
    from ray.serve._private.client import ServeControllerClient
    from ray.serve._private.controller import ServeController

    return (
        callable(getattr(serve_context, "_get_global_client", None))
        and callable(getattr(ServeControllerClient, "get_serve_details", None))
        and callable(getattr(ServeController, "get_serve_instance_details", None))
    )


PRIVATE_APIS: tuple[PrivateApi, ...] = (
    PrivateApi("DeploymentResponse._replica_result_future", "serve_internals.when_sent", _response_sent_future),
    PrivateApi("ray.serve.context._serve_request_context / _RequestContext._internal_request_id",
               "serve_internals.use_child_request_id", _context_api),
    PrivateApi("RequestRouter._use_replica_queue_len_cache", "serve_internals.cached_queue_len",
               _router_instance_attribute("_use_replica_queue_len_cache")),
    PrivateApi("RequestRouter._get_curr_time_s", "serve_internals.router_now_s",
               _router_instance_attribute("_get_curr_time_s")),
    PrivateApi("DeploymentHandle._router._asyncio_router.request_router", "serve_internals.request_router_of",
               _handle_router),
    PrivateApi("DeploymentHandle._router._asyncio_router._request_router",
               "serve_internals.initialized_request_router_of", _handle_router_no_init),
    PrivateApi("RunningReplica._actor_handle.record_routing_stats", "serve_internals.fetch_routing_stats",
               _replica_stats_on_demand),
    PrivateApi("ray.serve._private.constants.RAY_SERVE_USE_GRPC_BY_DEFAULT", "serve_internals.process_transport",
               _grpc_default),
    PrivateApi("gRPCGenericServer.service_handler_factory", "router/frontend/grpc_api/proxy.py", _grpc_handler_factory),
    PrivateApi("ray.serve.context._get_global_client()._controller.get_grpc_config",
               "serve_internals.grpc_servicer_functions, serve_internals.grpc_proxy_port", _controller_grpc_config),
    PrivateApi("ray.serve.context._get_global_client().get_serve_details", "serve_internals.serve_instance_details",
               _serve_details),
)
