"""cluster/sim/serving_cost.py: the serving layer's cores and ingress replicas for a token
rate, from measured CPU per token (the committed figures load; the arithmetic is exact)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.sim.serving_cost import INGRESS_REPLICA_CORES, KINDS, ServingCost, from_runs


def test_the_committed_figures_load_for_every_kind() -> None:
    cost = ServingCost.load()
    direct = cost.path(direct_ingress=True)
    assert cost.path(direct_ingress=False) is cost
    for per_token in (cost.streamed, cost.plain, direct.streamed, direct.plain):
        assert set(per_token) == set(KINDS) and all(v > 0 for v in per_token.values())


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


def test_direct_ingress_figures_round_trip_and_are_asked_for_when_missing(tmp_path: Path) -> None:
    def run(stream: bool, proxy: float) -> SimpleNamespace:
        return SimpleNamespace(stream=stream, tokens=1000, cpu_s={"proxy": proxy, "ingress": 0.2, "worker": 0.1})

    cost = from_runs([run(True, 0.3), run(False, 0.1)], "test", direct_runs=[run(True, 0.05), run(False, 0.01)])
    assert cost.path(direct_ingress=True).streamed == pytest.approx({"proxy": 0.05e-3, "ingress": 0.2e-3, "worker": 0.1e-3})
    path = tmp_path / "cost.json"
    path.write_text(cost.to_json())
    loaded = ServingCost.load(path)
    assert loaded == cost and loaded.source == "test"
    without = from_runs([run(True, 0.3), run(False, 0.1)], "test")
    assert "direct_ingress" not in without.to_json()
    with pytest.raises(ValueError, match="--direct-ingress --write-serving-cost"):
        without.path(direct_ingress=True)
