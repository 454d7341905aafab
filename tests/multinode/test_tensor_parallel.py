"""A tensor-parallel worker replica never spans hosts, and is replaced whole.

A host "t" with two GPUs (and kvserve_pool_tp: 2) runs one TP=2 replica: the Serve replica
(rank 0) and its rank-1 actor, in one STRICT_PACK placement group whose bundles the GCS
places on t only (asserted from the GCS's placement-group table). GPU hosts a and b have
room for one rank each (one kvserve_pool_tp unit), never for the group. When t is lost, Serve's replacement waits for a host that holds the whole group, and the new t
gets both ranks; it answers as before.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.multinode.conftest import INGRESS_RESOURCE, MultiNodeCluster
from tests.multinode.placement import app_config, completed, placements, run_streams
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

APP = "mn-tp"
TP_POOL = "kvserve_pool_tp"


@pytest.fixture(scope="module")
def app(multinode: MultiNodeCluster, model_dir: Path) -> Iterator[MultiNodeCluster]:
    from ray import serve

    from cluster.app import build_app

    multinode.add_host("t", num_cpus=2, num_gpus=2, resources={TP_POOL: 2})
    # num_gpus/num_cpus are the group's; kvserve_pool_tp is per rank (cluster/app.py).
    config = app_config(APP, model_dir,
                        {"num_replicas": 1, "tensor_parallel_size": 2, "num_gpus": 2, "num_cpus": 1,
                         "resources": {TP_POOL: 1}},
                        {"resources": {INGRESS_RESOURCE: 0.01}})
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    try:
        yield multinode
    finally:
        serve.delete(APP)
        if "t" in multinode.hosts:
            multinode.remove_host("t")


def _tp_groups() -> list[dict[str, Any]]:
    """The app's worker placement groups that the GCS has placed (CREATED)."""
    from ray.util import placement_group_table

    return [pg for pg in placement_group_table().values()
            if APP in (pg.get("name") or "") and pg.get("state") == "CREATED"]


def _group_nodes(pg: dict[str, Any]) -> set[str]:
    return {str(n) for n in pg["bundles_to_node_id"].values()}


def test_tp_group_stays_on_one_host_and_is_replaced_whole(app: MultiNodeCluster) -> None:
    mn = app
    url = f"{mn.head_url}/{APP}/v1/completions"
    (group,) = _tp_groups()
    assert group["strategy"] == "STRICT_PACK" and len(group["bundles"]) == 2
    assert _group_nodes(group) == {mn.hosts["t"].node_id}
    assert [p.node_id for p in placements(APP, "worker")] == [mn.hosts["t"].node_id]
    before = asyncio.run(run_streams([url] * 2, 24))
    assert all(completed(o, 24) for o in before)

    lost = mn.remove_host("t")
    # No other host can hold the group: its replacement waits rather than spread the ranks.
    wait_until(lambda: not placements(APP, "worker") and not _tp_groups(), 60, interval_s=0.5,
               message="the lost TP replica and its placement group to go")
    # Hosts a and b have a free rank's worth each (GPU, CPU, kvserve_pool_tp) but never
    # the whole group: nothing is placed until a host that holds it comes back.
    assert not _tp_groups() and not placements(APP, "worker")

    new_t = mn.readd_host(lost)
    wait_until(lambda: [p.node_id for p in placements(APP, "worker")] == [new_t.node_id], 180, interval_s=1.0,
               message="the replacement TP replica on the new host")
    (group,) = _tp_groups()
    assert _group_nodes(group) == {new_t.node_id}
    after = asyncio.run(run_streams([url] * 2, 24))
    assert [o.result.tokens for o in after] == [o.result.tokens for o in before]  # type: ignore[union-attr]
