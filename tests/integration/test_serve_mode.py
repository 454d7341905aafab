"""The session's Serve runs as `kvserve serve` runs it: its controller and proxy processes
start in Serve's throughput-optimized mode (cluster/serve_env.py), which they read from
their own environment at start-up, while this driver keeps Serve's defaults (its handles
are used from synchronous test code)."""
from __future__ import annotations

import os

import psutil
import pytest

from cluster.serve_env import THROUGHPUT_OPTIMIZED_ENV

pytestmark = pytest.mark.integration


def _environ(proc: psutil.Process) -> dict[str, str]:
    raw = open(f"/proc/{proc.pid}/environ", "rb").read().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def test_serve_processes_run_throughput_optimized(serve_cluster: object) -> None:
    found: dict[str, str | None] = {}
    # The session's local cluster runs under this driver (its raylet is our child process).
    for proc in psutil.Process().children(recursive=True):
        try:  # short-lived workers come and go (a zombie has no command line)
            cmdline = " ".join(proc.cmdline())
            kind = next((k for k in ("ServeController", "ProxyActor") if f"ray::{k}" in cmdline), None)
            if kind is not None:
                found[kind] = _environ(proc).get(THROUGHPUT_OPTIMIZED_ENV)
        except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError, ProcessLookupError):
            continue
    assert found == {"ServeController": "1", "ProxyActor": "1"}
    assert THROUGHPUT_OPTIMIZED_ENV not in os.environ
