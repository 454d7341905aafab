"""`kvserve simulate`: flags to SimConfig, JSON on stdout, the PNG plot, clear errors."""
from __future__ import annotations

import json

import pytest

from cluster.cli import main


def test_simulate_prints_json_and_writes_the_plot(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "out.png"
    rc = main(["simulate", "--replicas", "2", "--router", "round_robin", "--workload", "b2b", "--requests", "30",
               "--rate", "20", "--seed", "1", "--num-blocks", "4000", "--json", "--timelines", "--plot", str(png)])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_requests"] == 30 and summary["num_finished"] == 30
    assert summary["num_replicas_created"] == 2
    assert {"ttft_s", "itl_s", "e2e_s", "goodput_rps", "prefix_cache_hit_rate", "load_imbalance"} <= set(summary)
    timelines = summary["timelines"]["replicas"]
    assert len(timelines) == 2 and all(len(t["time_s"]) == len(t["kv_usage"]) > 0 for t in timelines)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_disaggregated_report(capsys) -> None:
    rc = main(["simulate", "--prefill-replicas", "1", "--decode-replicas", "1", "--requests", "10", "--rate", "5",
               "--num-blocks", "4000"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "TTFT" in out and "2 replicas" in out


def test_simulate_bad_workload_arguments_exit_2(capsys) -> None:
    assert main(["simulate", "--workload", "trace", "--requests", "5"]) == 2
    assert "path=" in capsys.readouterr().err
    assert main(["simulate", "--prefill-replicas", "1", "--requests", "5"]) == 2
    assert "decode_replicas" in capsys.readouterr().err


def test_simulate_shared_view_flags(capsys) -> None:
    assert main(["simulate", "--router", "headroom", "--ingress", "2", "--shared-view", "--shared-view-rtt-ms", "1",
                 "--replicas", "2", "--requests", "8", "--rate", "4", "--num-blocks", "2000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_finished"] == 8
    assert main(["simulate", "--router", "pow2", "--ingress", "2", "--shared-view", "--requests", "5"]) == 2
    assert "routing view" in capsys.readouterr().err



def test_simulate_kv_tier_flags(capsys) -> None:
    from cluster.cli import build_parser
    from cluster.sim.cli import config_from_args

    args = build_parser().parse_args(["simulate", "--host-kv-cache-gib", "4", "--disk-kv-cache-gib", "8",
                                      "--shared-kv-store-gib", "16", "--shared-kv-store-gbps", "80",
                                      "--tier-blind-routing"])
    tiers = config_from_args(args).tiers
    assert (tiers.host_bytes, tiers.disk_bytes, tiers.shared_bytes) == (4 * 2**30, 8 * 2**30, 16 * 2**30)
    assert tiers.shared_bandwidth == 10e9 and not tiers.route_on_tiers
    assert main(["simulate", "--requests", "5", "--disk-kv-cache-gib", "1"]) == 2
    assert "needs a host tier" in capsys.readouterr().err
    # A profile without a disk (every profile has a host link: PCIe Gen4 unless it says otherwise).
    assert main(["simulate", "--requests", "5", "--profile", "cpu-calibrated", "--host-kv-cache-gib", "1",
                 "--disk-kv-cache-gib", "1"]) == 2
    assert "(and disk) bandwidth" in capsys.readouterr().err


def test_simulate_plans_the_serving_layer_for_either_front_door(capsys) -> None:
    """Direct ingress by default, Serve's proxies with --serve-proxy, each with its own
    committed CPU per token (cluster/sim/serving_cost.json, as benchmarks.hostpath wrote it)."""
    import json
    from pathlib import Path

    cost = json.loads((Path(__file__).resolve().parents[3] / "cluster/sim/serving_cost.json").read_text())

    def us(section: dict) -> int:
        return round(1e6 * sum(section.values()))

    args = ["simulate", "--replicas", "1", "--requests", "10", "--rate", "5", "--num-blocks", "4000"]
    assert main(args) == 0
    default = [line for line in capsys.readouterr().out.splitlines() if "serving layer" in line]
    assert main(args + ["--serve-proxy"]) == 0
    proxy = [line for line in capsys.readouterr().out.splitlines() if "serving layer" in line]
    assert len(default) == len(proxy) == 2
    assert default[0].startswith(f"  serving layer (streamed, measured {us(cost['streamed'])} us of CPU per output token)")
    assert default[1].startswith(f"  serving layer (not streamed, measured {us(cost['plain'])} us of CPU per output token)")
    assert all("HAProxy (direct ingress)" in line and "Serve's HTTP proxies" not in line for line in default)
    assert us(cost["serve_proxy"]["streamed"]) > us(cost["streamed"])  # the proxies' extra hop costs
    assert proxy[0].startswith(f"  serving layer (streamed, measured {us(cost['serve_proxy']['streamed'])} us of CPU "
                               "per output token)")
    assert proxy[1].startswith(f"  serving layer (not streamed, measured {us(cost['serve_proxy']['plain'])} us of CPU "
                               "per output token)")
    assert all("Serve's HTTP proxies" in line and "HAProxy" not in line for line in proxy)


def test_simulate_with_the_slo_planner(capsys) -> None:
    assert main(["simulate", "--planner", "--slo-ttft-ms", "2000", "--slo-itl-ms", "50", "--startup-delay-s", "5",
                 "--autoscale-interval-s", "1", "--max-replicas", "3", "--requests", "40", "--rate", "20",
                 "--num-blocks", "4000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_finished"] == 40
    assert main(["simulate", "--planner", "--autoscale", "--requests", "5"]) == 2  # one sizes the pools, not both
    assert "choose one" in capsys.readouterr().err
