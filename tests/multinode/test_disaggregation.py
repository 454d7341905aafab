"""Prefill pool on one host, decode pool on another: the KV crosses raylets through Ray's
object store, and the answers are token-identical to a mixed pool's (on a third host).

Then a prefill host lost mid-transfer, made deterministic without any hook: the decode
replica takes one stream at a time (max_ongoing_requests 1) and is busy with a long
stream, so a second request's prefill finishes (its first token reaches the client, its
KV waits in the prefill replica's object store) while its decode call queues. The
prefill host is removed; the decode replica then finds the KV's owner dead
(KVSourceLostError), the ingress resumes the request on the decode pool from prompt +
first token, and the client's stream completes token-identical. When the host comes
back, Serve's replacement prefill replica serves new requests; no block is left held on
either pool.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.multinode.conftest import INGRESS_RESOURCE, MIXED_POOL, MultiNodeCluster
from tests.multinode.placement import app_config, completed, migrations_total, placements, run_streams
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

MIXED, DISAGG = "mn-pd-mixed", "mn-pd"
PREFILL_POOL = "kvserve_pool_prefill"
# Long enough to still hold the decode slot while two prefills finish and a host is removed.
LONG_TOKENS = 800


@pytest.fixture(scope="module")
def apps(multinode: MultiNodeCluster, model_dir: Path) -> Iterator[MultiNodeCluster]:
    from ray import serve

    from cluster.app import build_app

    multinode.add_host("p", num_cpus=1, num_gpus=1, resources={PREFILL_POOL: 1})
    ingress = {"resources": {INGRESS_RESOURCE: 0.01}, "max_migrations": 2}
    mixed = app_config(MIXED, model_dir, {"num_replicas": 1, "num_gpus": 1, "resources": {MIXED_POOL: 1}}, ingress)
    disagg = app_config(DISAGG, model_dir, {"num_replicas": 1}, ingress, disaggregation={
        "prefill": {"num_replicas": 1, "num_cpus": 1, "num_gpus": 1, "resources": {PREFILL_POOL: 1},
                    "health_check_period_s": 1.0},
        # Pinned to host a (kvserve_host_a), one stream at a time: see the module docstring.
        "decode": {"num_replicas": 1, "num_cpus": 1, "num_gpus": 1, "resources": {"kvserve_host_a": 0.5},
                   "max_ongoing_requests": 1, "health_check_period_s": 1.0},
        "max_waiting_for_decode": 16,
    })
    serve.run(build_app(mixed), name=MIXED, route_prefix=f"/{MIXED}")
    serve.run(build_app(disagg), name=DISAGG, route_prefix=f"/{DISAGG}")
    try:
        yield multinode
    finally:
        serve.delete(DISAGG)
        serve.delete(MIXED)
        if "p" in multinode.hosts:
            multinode.remove_host("p")


def _pools_idle_and_free() -> bool:
    from ray import serve

    for pool in ("prefill", "decode"):
        stats = serve.get_deployment_handle(pool, DISAGG).stats.remote().result(timeout_s=30)
        if stats["free_blocks"] != stats["total_blocks"] or stats["num_running"] or stats["num_waiting"]:
            return False
    return True


def test_prefill_and_decode_on_different_hosts_answer_as_the_mixed_pool(apps: MultiNodeCluster) -> None:
    mn = apps
    (prefill,), (decode,) = placements(DISAGG, "prefill"), placements(DISAGG, "decode")
    assert prefill.node_id == mn.hosts["p"].node_id and decode.node_id == mn.hosts["a"].node_id
    urls = [f"{mn.head_url}/{app}/v1/completions" for app in (MIXED, DISAGG)]
    mixed, disagg = asyncio.run(run_streams([urls[0]] * 3, 24)), asyncio.run(run_streams([urls[1]] * 3, 24))
    for m, d in zip(mixed, disagg):
        assert completed(m, 24) and completed(d, 24), (m, d)
        assert d.result.tokens == m.result.tokens  # type: ignore[union-attr]
    wait_until(_pools_idle_and_free, 60, interval_s=0.2, message="both pools idle with every block free")


def test_prefill_host_lost_mid_transfer_is_retried(apps: MultiNodeCluster) -> None:
    mn = apps
    root, url = f"{mn.head_url}/{DISAGG}", f"{mn.head_url}/{DISAGG}/v1/completions"
    mixed_url = f"{mn.head_url}/{MIXED}/v1/completions"
    expected = asyncio.run(run_streams([mixed_url] * 2, 64))
    before = migrations_total(root)

    async def scenario() -> tuple[list, list, Any]:
        long_started, first_tokens = asyncio.Event(), asyncio.Event()
        # A long stream occupies the one decode slot; two more then prefill and wait.
        long = asyncio.create_task(run_streams([url], LONG_TOKENS, long_started, min_chunks=2))
        await asyncio.wait_for(long_started.wait(), 120)
        waiting = asyncio.create_task(run_streams([url, url], 64, first_tokens, min_chunks=1))
        await asyncio.wait_for(first_tokens.wait(), 120)  # both have their first token: their KV is exported
        lost = await asyncio.to_thread(mn.remove_host, "p")
        return await long, await waiting, lost

    (long,), (waiting_0, waiting_1), lost = asyncio.run(scenario())
    assert completed(long, LONG_TOKENS), long
    for got, ref in ((waiting_0, expected[0]), (waiting_1, expected[1])):
        assert completed(got, 64), got
        assert got.result.tokens == ref.result.tokens  # type: ignore[union-attr]
    assert migrations_total(root) - before >= 1  # resumed on the decode pool

    # The host comes back: Serve's replacement prefill replica serves new requests.
    host = mn.readd_host(lost)
    wait_until(lambda: [p.node_id for p in placements(DISAGG, "prefill")] == [host.node_id], 180, interval_s=1.0,
               message="the replacement prefill replica")
    again = asyncio.run(run_streams([url] * 2, 64))
    assert [o.result.tokens for o in again] == [o.result.tokens for o in expected]  # type: ignore[union-attr]
    wait_until(_pools_idle_and_free, 60, interval_s=0.2, message="both pools idle with every block free")
    assert httpx.get(f"{root}/health", timeout=30).status_code == 200
