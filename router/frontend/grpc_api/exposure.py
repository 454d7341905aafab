"""Who may reach the gRPC API: loopback only when a local server has no API keys, and no
message larger than the HTTP body cap.

Serve 2.60's gRPC proxy has no host option: it binds [::]:port, every interface
(ray/serve/_private/grpc_util.py start_grpc_server). A local `kvserve serve` without API
keys must not be a service for the whole network, so there the proxy answers only
loopback peers: kvserve's servicer function (router/frontend/grpc_api/proxy.py) wraps every
KVServe handler in `loopback_guard`, which refuses any other peer with
PERMISSION_DENIED before the request is read or routed. The switch is the environment of
the node the proxy runs on, as for TLS (router/frontend/grpc_api/tls.py):

    KVSERVE_GRPC_LOOPBACK_ONLY=1      set by `kvserve serve` when gRPC is on, no API keys
                                      are set and `grpc.public` (--grpc-public) is not

Serve's proxy reads its message-size limit (send and receive) from
RAY_SERVE_GRPC_MAX_MESSAGE_SIZE when it starts; unset, it takes up to 2 GiB into memory
before the ingress sees the message (and its key). `kvserve serve` and the Helm chart set
it to `ingress.max_body_bytes`, the HTTP body cap, so both front ends refuse the same
sizes at their door (grpc answers RESOURCE_EXHAUSTED).
"""
from __future__ import annotations

import ipaddress
import os
from urllib.parse import unquote
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

LOOPBACK_ONLY_ENV = "KVSERVE_GRPC_LOOPBACK_ONLY"
# Serve's own variable (ray/serve/_private/constants.py), read once when the proxy starts.
MAX_MESSAGE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"


def loopback_only(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(LOOPBACK_ONLY_ENV, "").strip() == "1"


def is_loopback_peer(peer: str) -> bool:
    """grpc's `context.peer()` (`ipv4:127.0.0.1:5000`, `ipv6:[::1]:5000` or its
    percent-encoded form `ipv6:%5B::1%5D:5000`, `unix:/path`) names a caller on this
    machine. Anything unparsable is not."""
    kind, _, address = unquote(peer).partition(":")
    if kind == "unix":
        return True
    if kind == "ipv4":
        host = address.rpartition(":")[0]
    elif kind == "ipv6":
        host = address.partition("]")[0].lstrip("[")
    else:
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:a.b.c.d: an IPv4 client on a dual-stack socket
    return (mapped or ip).is_loopback


def loopback_guard(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """A coroutine handler (request, context) that refuses non-loopback peers."""

    async def guarded(request: Any, context: Any) -> Any:
        if not is_loopback_peer(context.peer() or ""):
            import grpc

            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "This server answers gRPC on loopback only: it has no API keys. Set API keys "
                "(KVSERVE_API_KEYS) or start it with --grpc-public (grpc.public: true).",
            )
            return None
        return await handler(request, context)

    return guarded
