"""Operating a running app, through real Serve: tracing (OpenTelemetry over real OTLP/HTTP,
cluster/tracing.py) and `kvserve status` (cluster/status.py), on one app with two worker
replicas on the tiny model.

Tracing: the replicas export with the real OTLP exporter to a receiver in this process
(tests/integration/otlp_receiver.py); the test waits until one request's whole trace has
arrived (the exporters batch, so that takes seconds), never sleeping a guessed time.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration import tiny_app
from tests.integration.otlp_receiver import OTLPReceiver, ReceivedSpan

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

APP = "operating-test"
MODEL = "tiny-operating"
NUM_WORKERS = 2
MAX_TOKENS = 5
ROOT = Path(__file__).resolve().parents[2]
TRACE_NAMES = {"kvserve.request", "kvserve.generate", "kvserve.route", "kvserve.replica",
               "kvserve.engine.queue", "kvserve.engine.prefill", "kvserve.engine.decode"}


@dataclass
class App:
    root: str
    receiver: OTLPReceiver


@pytest.fixture(scope="module")
def app(serve_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    from ray import serve

    from tests.support.tiny_served_model import make_served_model

    receiver = OTLPReceiver()
    model_dir = make_served_model(tmp_path_factory.mktemp("operating") / "tiny")
    config = tiny_app.tiny_config(APP, model_dir, MODEL).with_overrides({
        "workers.num_replicas": NUM_WORKERS,
        "observability.otlp_endpoint": receiver.endpoint,
        "observability.otlp_protocol": "http/protobuf",
        "observability.accept_client_trace_context": True,
    })
    tiny_app.deploy(config)
    try:
        yield App(f"{serve_cluster.http_url}/{APP}", receiver)
    finally:
        serve.delete(APP)
        receiver.close()


def complete(app: App, prompt: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{app.root}/v1/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def trace_of(request_id: str, spans: list[ReceivedSpan]) -> list[ReceivedSpan] | None:
    """The request's whole trace once every kind of span in it has arrived, else None."""
    roots = [s for s in spans if s.name == "kvserve.request" and s.attributes.get("kvserve.request_id") == request_id]
    if not roots:
        return None
    trace = [s for s in spans if s.trace_id == roots[0].trace_id]
    return trace if TRACE_NAMES <= {s.name for s in trace} else None


CLIENT_TRACE, CLIENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


def test_one_request_is_one_trace_across_ingress_router_and_replica(app: App) -> None:
    # The client's own trace continues (observability.accept_client_trace_context).
    answer = complete(app, "Hello world", {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    trace = app.receiver.wait_for(lambda spans: trace_of(answer["id"], spans), f"the trace of {answer['id']}")
    one = {s.name: s for s in trace}
    assert sorted(s.name for s in trace) == sorted(TRACE_NAMES)  # one of each: n=1, no migration
    request, generate, route, replica = (one[f"kvserve.{n}"] for n in ("request", "generate", "route", "replica"))

    # Parent links across three hops: ingress -> its router thread -> a worker process.
    assert request.trace_id == CLIENT_TRACE and request.parent_span_id == CLIENT_SPAN
    assert generate.parent_span_id == request.span_id
    assert route.parent_span_id == generate.span_id
    assert replica.parent_span_id == generate.span_id
    for phase in ("queue", "prefill", "decode"):
        assert one[f"kvserve.engine.{phase}"].parent_span_id == replica.span_id
    assert "first_token" in replica.events

    # Who recorded what: the ingress replica's process and a worker replica's process.
    assert {s.resource["kvserve.component"] for s in (request, generate, route)} == {"ingress"}
    assert {one[n].resource["kvserve.component"] for n in TRACE_NAMES if n.startswith("kvserve.engine") or n == "kvserve.replica"} == {"worker"}
    assert request.resource["service.name"] == "kvserve"

    # The attributes: ids, token counts (as the client was billed), the replica the router
    # chose is the one that served, and how it chose.
    usage = answer["usage"]
    assert request.attributes["kvserve.request_id"] == answer["id"]
    assert request.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert request.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == MAX_TOKENS
    assert generate.attributes["kvserve.request_id"] == replica.attributes["kvserve.request_id"] == f"{answer['id']}-0"
    assert replica.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert route.attributes["kvserve.routing.replica"] == replica.attributes["kvserve.replica"] != "local"
    assert route.attributes["kvserve.routing.num_candidates"] == NUM_WORKERS
    assert route.attributes["kvserve.routing.mode"] in ("headroom", "load_gate", "pow2")


def test_status_shows_pools_replicas_per_node_and_kv(app: App) -> None:
    """`kvserve status --json` in its own process, joining the session cluster as a driver."""
    import ray

    complete(app, "Status please")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    address = ray.get_runtime_context().gcs_address
    result = subprocess.run([sys.executable, "-m", "cluster.cli", "status", "--address", address, "--app", APP, "--json"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    status = json.loads(result.stdout)
    assert status["app_name"] == APP and status["app_status"] == "RUNNING"
    pools = {p["name"]: p for p in status["pools"]}
    assert [p["name"] for p in status["pools"]] == ["ingress", "worker"]
    ingress, worker = pools["ingress"], pools["worker"]
    assert ingress["role"] == "ingress" and ingress["num_running_replicas"] == ingress["target_num_replicas"] == 1
    assert ingress["num_in_flight"] == 0  # nothing running now: the request above has ended
    assert worker["role"] == "worker" and worker["status"] == "HEALTHY"
    assert worker["num_running_replicas"] == worker["target_num_replicas"] == NUM_WORKERS
    assert worker["autoscaling"] is None  # a fixed number of replicas
    assert worker["kv_total_blocks"] == NUM_WORKERS * tiny_app.NUM_BLOCKS
    assert worker["num_running"] == worker["num_waiting"] == 0
    # Replicas per node: one node here, holding the ingress replica and both workers.
    (node,) = status["nodes"].values()
    assert node["node_ip"] == "127.0.0.1"
    replicas = node["replicas"]
    assert sorted(r["pool"] for r in replicas) == ["ingress", "worker", "worker"]
    for r in replicas:
        assert r["state"] == "RUNNING" and r["pid"]
        if r["pool"] == "worker":  # the engine's own numbers, as its routing stats carry them
            assert r["kv_total_blocks"] == tiny_app.NUM_BLOCKS and 0 <= r["kv_used_blocks"] <= tiny_app.NUM_BLOCKS
            assert r["kv_usage"] == r["kv_used_blocks"] / r["kv_total_blocks"]
            assert r["num_waiting"] == 0 and r["num_waiting_prompt_tokens"] == 0
        else:
            assert r["kv_total_blocks"] is None
