"""Which node losses break a client's stream (docs/operations.md "Reliability").

A host "c" runs the ingress replica of app `on-gpu` (an ingress scheduled onto a GPU host)
and, because it hosts a replica, a Serve proxy. App `off-gpu` has its ingress on the CPU
ingress node. Both apps' workers run on the surviving GPU hosts. Streams run:

- to `on-gpu` through the head's proxy      -> its ingress dies with c: the stream breaks
- to `off-gpu` through c's proxy            -> the client's proxy dies with c: it breaks
- to `off-gpu` through the head's proxy     -> nothing it uses is on c: token-identical

A broken stream ends promptly and visibly (the connection is cut or an error event
arrives; never a 200 stream that looks finished), and the apps whose ingress survived
serve new requests at once.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.multinode.conftest import INGRESS_RESOURCE, MIXED_POOL, MultiNodeCluster
from tests.multinode.placement import Outcome, app_config, completed, greedy_body, placements, run_streams

pytestmark = pytest.mark.integration

ON_GPU, OFF_GPU = "mn-ing-gpu", "mn-ing-cpu"
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def apps(multinode: MultiNodeCluster, model_dir: Path) -> Iterator[MultiNodeCluster]:
    from ray import serve

    from cluster.app import build_app

    multinode.add_host("c", num_cpus=1, num_gpus=1)
    workers = {"num_replicas": 1, "num_gpus": 1, "resources": {MIXED_POOL: 1}}
    serve.run(build_app(app_config(ON_GPU, model_dir, workers, {"resources": {"kvserve_host_c": 0.01}})),
              name=ON_GPU, route_prefix=f"/{ON_GPU}")
    serve.run(build_app(app_config(OFF_GPU, model_dir, workers, {"resources": {INGRESS_RESOURCE: 0.01}})),
              name=OFF_GPU, route_prefix=f"/{OFF_GPU}")
    try:
        yield multinode
    finally:
        serve.delete(ON_GPU)
        serve.delete(OFF_GPU)
        if "c" in multinode.hosts:
            multinode.remove_host("c")


def _broken_cleanly(o: Outcome) -> bool:
    """The client can tell: the connection was cut, or the stream carried an error, or it
    ended without a finish reason. Never a clean-looking finished stream."""
    if o.transport_error is not None:
        return True
    r = o.result
    assert r is not None
    return r.status != 200 or r.error is not None or r.finish_reason is None


def test_losing_the_ingress_or_the_clients_proxy_breaks_the_stream_and_nothing_else(
    apps: MultiNodeCluster,
) -> None:
    mn = apps
    c = mn.hosts["c"]
    assert {p.node_id for p in placements(ON_GPU, "ingress")} == {c.node_id}
    assert {p.node_id for p in placements(OFF_GPU, "ingress")} == {mn.hosts["ingress"].node_id}
    assert c.node_id not in {p.node_id for app in (ON_GPU, OFF_GPU) for p in placements(app, "worker")}
    # c's proxy serves (it runs because c hosts a replica).
    assert httpx.get(f"{c.proxy_url}/{OFF_GPU}/health", timeout=60).status_code == 200

    urls = [
        f"{mn.head_url}/{ON_GPU}/v1/completions",   # ingress on c
        f"{c.proxy_url}/{OFF_GPU}/v1/completions",  # client's proxy on c
        f"{mn.head_url}/{OFF_GPU}/v1/completions",  # nothing on c
    ]
    # Stream i gets prompt i: the survivor is stream 2; its undisturbed run first.
    undisturbed = asyncio.run(run_streams([urls[2]] * 3, MAX_TOKENS))[2]
    assert completed(undisturbed, MAX_TOKENS)

    async def disturbed() -> list[Outcome]:
        started = asyncio.Event()
        streams = asyncio.create_task(run_streams(urls, MAX_TOKENS, started))
        await asyncio.wait_for(started.wait(), 120)
        await asyncio.to_thread(mn.remove_host, "c")
        return await asyncio.wait_for(streams, 180)  # a broken stream must not hang

    on_gpu, via_lost_proxy, survivor = asyncio.run(disturbed())
    assert _broken_cleanly(on_gpu), on_gpu
    assert _broken_cleanly(via_lost_proxy), via_lost_proxy
    assert completed(survivor, MAX_TOKENS), survivor
    assert survivor.result.tokens == undisturbed.result.tokens  # type: ignore[union-attr]

    # The app whose ingress survived answers new requests at once.
    for i in range(3):
        r = httpx.post(f"{mn.head_url}/{OFF_GPU}/v1/completions", json=greedy_body(i, 8), timeout=120)
        assert r.status_code == 200, r.text
    print(f"\nINGRESS-PLACEMENT on_gpu={_describe(on_gpu)} via_lost_proxy={_describe(via_lost_proxy)}")


def _describe(o: Outcome) -> str:
    if o.transport_error is not None:
        return f"transport:{o.transport_error.split(':')[0]}"
    r = o.result
    return f"status={r.status} finish={r.finish_reason} error={(r.error or {}).get('message', '')[:60]!r}"  # type: ignore[union-attr]


def test_by_default_the_ingress_lands_off_the_gpu_hosts(multinode: MultiNodeCluster, model_dir: Path) -> None:
    """`kvserve serve --address` on a bare cluster of KubeRay's shape (a head with no CPUs, a
    CPU node, GPU hosts with CPUs of their own) and an ingress section that names no
    resources: every ingress replica is placed on the CPU node (cluster/app.py's
    ingress_placement), and the app serves."""
    from ray import serve

    from cluster.app import build_app

    app = "mn-ing-default"
    ingress = {"num_replicas": 2}  # no `resources`: the default placement decides
    serve.run(build_app(app_config(app, model_dir, {"num_replicas": 1}, ingress)), name=app, route_prefix=f"/{app}")
    try:
        gpu_hosts = {h.node_id for name, h in multinode.hosts.items() if h.args["num_gpus"] > 0}
        where = {p.node_id for p in placements(app, "ingress")}
        assert len(placements(app, "ingress")) == 2
        assert where == {multinode.hosts["ingress"].node_id}, (where, gpu_hosts)
        r = httpx.post(f"{multinode.head_url}/{app}/v1/completions", json=greedy_body(0, 8), timeout=120)
        assert r.status_code == 200, r.text
    finally:
        serve.delete(app)
