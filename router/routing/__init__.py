"""Routing: which worker replica serves a request, and whether it is admitted now.

The frontend (router/frontend/) imports from this package's surface only, below; the rest
is internal (tests/unit/test_layering.py enforces it). The Ray Serve side is configured by
name, not imported: the worker deployment runs `ROUTER_CLASS` (router/routing/serve_router.py),
one adapter for every policy of router/routing/policies/.
"""
from __future__ import annotations

from router.routing.admission import AdmissionController, SnapshotSource, Ticket
from router.routing.admission_source import RouterSnapshotSource
from router.routing.cold_start import DEFAULT_RETRY_AFTER_S, NO_BOUND, ColdStartBound
from router.routing.sessions import SESSION_HEADER, client_session_id
from router.routing.types import RequestProfile, request_hash_root

# Serve's RequestRouterConfig.request_router_class for the worker deployments.
ROUTER_CLASS = "router.routing.serve_router:PolicyRouter"

__all__ = [
    "ROUTER_CLASS",
    "SESSION_HEADER",
    "AdmissionController",
    "ColdStartBound",
    "DEFAULT_RETRY_AFTER_S",
    "NO_BOUND",
    "RequestProfile",
    "RouterSnapshotSource",
    "SnapshotSource",
    "Ticket",
    "client_session_id",
    "request_hash_root",
]
