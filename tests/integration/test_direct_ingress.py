"""Direct ingress, `kvserve serve`'s default front door (http.direct_ingress, here insisted
on): Serve's HAProxy on the HTTP and gRPC ports, forwarding to the ingress replicas, which
serve both themselves; no Serve proxy in the path.

A whole `kvserve serve` process of its own (the session cluster runs Serve's proxies, and
the mode is read by every Serve process at start). The official openai client and a grpcio
client both go through HAProxy: greedy text is the same streamed, not streamed and over
gRPC; HAProxy's stats and Prometheus listeners take the configured ports, on the HTTP
host (loopback) like every HAProxy listener.
"""
from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from tests.integration.conftest import free_port
from tests.support.serve_process import kvserve_serve, short_ray_tmp
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

MODEL = "kvserve-tiny"
PROMPT = "The capital of France is"


def _processes(root: psutil.Process) -> list[tuple[str, list[tuple[str, int]]]]:
    """(command line, listening (address, port)s) of `root` and its descendants."""
    found = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            listening = [(c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="tcp")
                         if c.status == psutil.CONN_LISTEN]
            found.append((" ".join(proc.cmdline()), listening))
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            continue
    return found


def _cluster_metrics(root: str) -> dict[str, float]:
    """kvserve's unlabelled-by-replica series (cluster sums, counters) from /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{root}/metrics", timeout=30).text
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if "replica" not in sample.labels}


def _disconnect_aborts_through_haproxy(root: str) -> None:
    """A client that leaves mid-stream: HAProxy closes its connection to the ingress
    replica, which aborts the engine request and frees its blocks; the server goes on."""
    import httpx

    max_tokens = 480
    before = _cluster_metrics(root)
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{root}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        received = 0
        for line in r.iter_lines():
            received += bool(line)
            if received == 3:
                break  # leaving the block closes the connection mid-stream
    settled: list[dict[str, float]] = []

    def idle() -> bool:
        m = _cluster_metrics(root)
        settled[:] = [m]
        return (m["kvserve:cluster_num_requests_running"] == 0 and m["kvserve:cluster_num_requests_waiting"] == 0
                and m["kvserve:cluster_kv_cache_free_blocks"] == m["kvserve:cluster_kv_cache_total_blocks"])

    wait_until(idle, 30, interval_s=0.2, message="the disconnected request's blocks to be freed")
    generated = settled[0].get("kvserve:generation_tokens_total", 0) - before.get("kvserve:generation_tokens_total", 0)
    assert generated < max_tokens  # aborted, not run to its end
    r = httpx.post(f"{root}/v1/completions", json={"model": MODEL, "prompt": "Still there?", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_http_and_grpc_through_haproxy_to_the_ingress_replicas(tmp_path: Path) -> None:
    import grpc
    from openai import OpenAI

    from protos.kvserve.v1 import kvserve_pb2 as pb
    from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc

    port, grpc_port, stats_port, metrics_port, fallback_port, fallback_grpc_port = (free_port() for _ in range(6))
    config = (
        "engine: {device: cpu, dtype: float32, num_threads: 1, num_blocks: 64}\n"
        "workers: {num_replicas: 1, num_cpus: 1, drain_timeout_s: 5}\n"
        "ingress: {num_cpus: 0.5}\n"
        f"http: {{direct_ingress: true, haproxy_stats_port: {stats_port}, haproxy_metrics_port: {metrics_port},"
        f" fallback_proxy_port: {fallback_port}, fallback_proxy_grpc_port: {fallback_grpc_port}}}\n"
    )
    with kvserve_serve(tmp_path, config, port, grpc_port, short_ray_tmp("kvdi-")) as served:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60)
        whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True) if chunk.choices)
        assert whole.usage.completion_tokens > 0 and whole.choices[0].text
        assert streamed == whole.choices[0].text

        replies: list[pb.GenerateResponse] = []

        def generated() -> bool:  # HAProxy learns of the replicas' gRPC ports asynchronously
            try:
                replies.append(stub.Generate(pb.GenerateRequest(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0),
                                             metadata=(("application", "kvserve"),), timeout=60))
                return True
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                return False

        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.KVServeStub(channel)
            wait_until(generated, 60, interval_s=0.5, message="HAProxy to route gRPC to the ingress replica")
        assert replies[0].text == whole.choices[0].text
        _disconnect_aborts_through_haproxy(f"http://127.0.0.1:{port}")

        processes = _processes(psutil.Process(served.proc.pid))
        listeners = {p: cmd for cmd, ports in processes for _, p in ports}
        assert {ip for cmd, ports in processes if "haproxy" in cmd.split(" ")[0] for ip, _ in ports} == {"127.0.0.1"}
        # HAProxy holds the client-facing ports; Serve's proxy only the head's fallback.
        for p in (port, grpc_port, stats_port, metrics_port):
            assert "haproxy" in listeners.get(p, "").split(" ")[0], (p, listeners)
        for p in (fallback_port, fallback_grpc_port):
            assert "ray::ProxyActor" in listeners.get(p, ""), (p, listeners)

        # HAProxy's files, its mode-666 admin socket among them, sit in a directory of
        # kvserve's that only this user can enter, not in /tmp/haproxy-serve.
        commands = [cmd.split(" ") for cmd, _ in _processes(psutil.Process(served.proc.pid))]
        configs = {Path(arg) for cmd in commands if "haproxy" in cmd[0] for arg in cmd if arg.endswith("haproxy.cfg")}
        assert len(configs) == 1, commands
        private = next(iter(configs)).parent.parent  # Serve adds the node's subdirectory
        assert private.name.startswith("kvh-") and private.stat().st_mode & 0o777 == 0o700
        assert list(private.glob("*/admin.sock")), sorted(private.rglob("*"))
    assert not private.exists()  # removed when kvserve serve stopped
    # HAProxy is local: the ingress replica does not hold shutdown open for Serve's
    # external-load-balancer window (cluster/serve_env.py LOCAL_DRAINING_PERIOD_S).
    assert "failed to shut down" not in served.log()
