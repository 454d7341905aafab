"""cluster/sim/serving_cost.py: the serving layer's cores and ingress replicas for a token
rate, from measured CPU per token (the committed figures load; the arithmetic is exact)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.sim.serving_cost import INGRESS_REPLICA_CORES, KINDS, ServingCost, describe, from_runs


def test_the_committed_figures_load_for_every_kind() -> None:
    cost = ServingCost.load()
    proxy = cost.path(serve_proxy=True)
    assert cost.path(serve_proxy=False) is cost
    for per_token in (cost.streamed, cost.plain, proxy.streamed, proxy.plain):
        assert set(per_token) == set(KINDS) and all(v > 0 for v in per_token.values())
    # The plan at one token a second is the committed per-token CPU (cluster/sim/serving_cost.json,
    # as benchmarks.hostpath wrote it), for the default front door and for Serve's proxies;
    # HAProxy costs less than a third of Serve's proxies.
    def us(per_token: dict[str, float]) -> int:
        return round(1e6 * sum(per_token.values()))

    assert [round(cost.plan(1.0, 1, streamed)["us_per_token"]) for streamed in (True, False)] == \
        [us(cost.streamed), us(cost.plain)]
    assert [round(proxy.plan(1.0, 1, streamed)["us_per_token"]) for streamed in (True, False)] == \
        [us(proxy.streamed), us(proxy.plain)]
    assert cost.streamed["proxy"] < proxy.streamed["proxy"] / 3 and cost.plain["proxy"] < proxy.plain["proxy"] / 3


def test_the_plan_scales_with_the_token_rate() -> None:
    cost = ServingCost({"proxy": 50e-6, "ingress": 100e-6, "worker": 50e-6}, {"proxy": 10e-6, "ingress": 20e-6, "worker": 10e-6})
    plan = cost.plan(20_000, num_devices=8)
    assert plan["cores"] == pytest.approx({"proxy": 1.0, "ingress": 2.0, "worker": 1.0})
    assert plan["total_cores"] == pytest.approx(4.0) and plan["cores_per_device"] == pytest.approx(0.5)
    assert plan["ingress_replicas"] == int(-(-2.0 // INGRESS_REPLICA_CORES))
    assert plan["us_per_token"] == pytest.approx(200.0)
    assert cost.plan(20_000, 8, streamed=False)["total_cores"] == pytest.approx(0.8)


def test_from_runs_is_a_ratio_of_sums_per_kind() -> None:
    def run(stream: bool, tokens: int, ingress: float) -> SimpleNamespace:
        return SimpleNamespace(stream=stream, tokens=tokens, cpu_s={"proxy": 0.1, "ingress": ingress, "worker": 0.2})

    cost = from_runs([run(True, 1000, 0.3), run(True, 3000, 0.5), run(False, 2000, 0.1)], "test")
    assert cost.streamed == pytest.approx({"proxy": 0.2 / 4000, "ingress": 0.8 / 4000, "worker": 0.4 / 4000})
    assert cost.plain == pytest.approx({"proxy": 0.1 / 2000, "ingress": 0.1 / 2000, "worker": 0.2 / 2000})


def test_serve_proxy_figures_round_trip_and_are_asked_for_when_missing(tmp_path: Path) -> None:
    def run(stream: bool, proxy: float) -> SimpleNamespace:
        return SimpleNamespace(stream=stream, tokens=1000, cpu_s={"proxy": proxy, "ingress": 0.2, "worker": 0.1})

    cost = from_runs([run(True, 0.05), run(False, 0.01)], "test", proxy_runs=[run(True, 0.3), run(False, 0.1)])
    assert cost.streamed == pytest.approx({"proxy": 0.05e-3, "ingress": 0.2e-3, "worker": 0.1e-3})
    assert cost.path(serve_proxy=True).streamed == pytest.approx({"proxy": 0.3e-3, "ingress": 0.2e-3, "worker": 0.1e-3})
    assert cost.path(serve_proxy=True).plain == pytest.approx({"proxy": 0.1e-3, "ingress": 0.2e-3, "worker": 0.1e-3})
    path = tmp_path / "cost.json"
    path.write_text(cost.to_json())
    data = json.loads(path.read_text())
    assert set(data) == {"streamed", "plain", "source", "serve_proxy"}
    assert data["serve_proxy"]["plain"]["proxy"] == pytest.approx(0.1e-3)
    loaded = ServingCost.load(path)
    assert loaded == cost and loaded.source == "test"
    without = from_runs([run(True, 0.05), run(False, 0.01)], "test")
    assert "serve_proxy" not in without.to_json()
    with pytest.raises(ValueError, match=r"python -m benchmarks\.hostpath --serve-proxy --write-serving-cost"):
        without.path(serve_proxy=True)
    assert without.path(serve_proxy=False) is without


def test_describe_names_the_front_door() -> None:
    cost = ServingCost({"proxy": 50e-6, "ingress": 100e-6, "worker": 50e-6},
                       {"proxy": 10e-6, "ingress": 20e-6, "worker": 10e-6})
    plan = cost.plan(20_000, num_devices=8)
    assert describe(plan) == ("serving layer (streamed, measured 200 us of CPU per output token): 4.0 cores = 0.50 "
                              "per device (ingress 2.0 in 3 replicas, HAProxy (direct ingress) 1.0, "
                              "workers' host side 1.0)")
    plain = cost.plan(20_000, num_devices=8, streamed=False)
    assert describe(plain, streamed=False, serve_proxy=True) == (
        "serving layer (not streamed, measured 40 us of CPU per output token): 0.8 cores = 0.10 per device "
        "(ingress 0.4 in 1 replicas, Serve's HTTP proxies 0.2, workers' host side 0.2)")
