"""gRPC exposure (issue 30): a local `kvserve serve` answers gRPC on loopback only unless
API keys are set or `--grpc-public` opens it, and Serve's gRPC proxy refuses messages over
the HTTP body cap before they reach a replica or any key is checked."""
from __future__ import annotations

from typing import Any

import grpc
import pytest

from cluster.cli import build_parser, config_from_args
from cluster.serve_exposure import grpc_proxy_env
from cluster.config import KVServeConfig
from router.frontend.grpc_api import proxy
from router.frontend.grpc_api.exposure import LOOPBACK_ONLY_ENV, MAX_MESSAGE_ENV, is_loopback_peer


class Aborted(Exception):
    pass


class PeerContext:
    def __init__(self, peer: str) -> None:
        self._peer = peer
        self.code: grpc.StatusCode | None = None

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise Aborted(details)


def test_local_grpc_is_loopback_only_without_keys() -> None:
    # Finding: `kvserve serve` opened gRPC on [::]:9000 with auth off by default.
    config = config_from_args(build_parser().parse_args(["serve"]))
    assert grpc_proxy_env(config, environ={})[LOOPBACK_ONLY_ENV] == "1"
    # Keys configured, or the explicit flag: open.
    assert LOOPBACK_ONLY_ENV not in grpc_proxy_env(config, environ={"KVSERVE_API_KEYS": "k"})
    public = config_from_args(build_parser().parse_args(["serve", "--grpc-public"]))
    assert public.grpc.public and LOOPBACK_ONLY_ENV not in grpc_proxy_env(public, environ={})


@pytest.mark.parametrize(
    ("peer", "loopback"),
    [("ipv4:127.0.0.1:5000", True), ("ipv6:[::1]:5000", True), ("ipv6:%5B::1%5D:5000", True), ("ipv6:[::ffff:127.0.0.1]:5000", True),
     ("unix:/tmp/s", True), ("ipv4:10.1.2.3:5000", False), ("ipv6:[2001:db8::1]:5000", False),
     ("ipv6:[::ffff:10.1.2.3]:5000", False), ("", False), ("garbage", False)],
)
def test_loopback_peers(peer: str, loopback: bool) -> None:
    assert is_loopback_peer(peer) is loopback


async def test_the_proxy_refuses_remote_peers_when_loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOOPBACK_ONLY_ENV, "1")
    calls: list[Any] = []

    async def unary(request: Any, context: Any) -> str:
        calls.append(request)
        return "ok"

    handler = proxy._cancel_safe_factory(lambda *a, **k: unary)()
    assert await handler("r", PeerContext("ipv4:127.0.0.1:1")) == "ok"
    remote = PeerContext("ipv4:192.168.1.9:1")
    with pytest.raises(Aborted, match="--grpc-public"):
        await handler("r", remote)
    assert remote.code == grpc.StatusCode.PERMISSION_DENIED and calls == ["r"]


def test_grpc_message_cap_is_the_http_body_cap() -> None:
    # Finding: Serve's proxy accepted gRPC messages up to 2 GiB before any key was checked.
    config = KVServeConfig().with_overrides({"ingress.max_body_bytes": "8MiB"})
    assert grpc_proxy_env(config, environ={})[MAX_MESSAGE_ENV] == str(8 * 1024**2)
    assert MAX_MESSAGE_ENV == "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"  # Serve's own variable (ray.serve._private.constants)
    from ray.serve._private import constants

    assert hasattr(constants, "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE")


@pytest.mark.parametrize(("max_body_bytes", "expected"), [(None, None), ("8MiB", 8 * 1024**2), ("1.5MB", 1_500_000), (65536, 65536)])
def test_chart_caps_grpc_messages_at_the_body_cap(max_body_bytes: Any, expected: int | None) -> None:
    # The same finding in the Helm chart: every pod's Serve gRPC proxy gets the cap.
    from router.frontend.settings import IngressSettings
    from tests.helm.chart import Rendered, render_job, require_helm, run_jobs

    require_helm()
    values: dict[str, Any] = {} if max_body_bytes is None else {"kvserve": {"ingress": {"max_body_bytes": max_body_bytes}}}
    (result,) = run_jobs([render_job(values)])
    assert result["ok"], result.get("error")
    if expected is None:  # unset: the ingress's own default
        expected = IngressSettings("m", "t").max_body_bytes
    for _, template in Rendered(values, result["manifests"]).pod_templates():
        (container,) = template["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[MAX_MESSAGE_ENV] == str(expected)
