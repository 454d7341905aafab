"""benchmarks/hostpath.py's engine part: how it counts exposed host time (on synthetic
timelines), and that a quick run ends with its RESULT line, serve_* through the default
front door (direct ingress) and proxy_* through Serve's proxies. No timing is asserted."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import hostpath
from benchmarks.hostpath import DeviceStep, DeviceTimeline
from benchmarks.hostpath_serve import ServeRun, delivered_vs_engine, measure_serve
from cluster.sim.serving_cost import ServingCost


def step(start_cpu: float, window_cpu: float, end_cpu: float, modelled_s: float) -> DeviceStep:
    return DeviceStep(start_cpu, start_wall=0.0, modelled_s=modelled_s, window_cpu=window_cpu, end_cpu=end_cpu)


def test_exposed_host_time_is_the_gaps_plus_work_past_the_device_windows() -> None:
    timeline = DeviceTimeline(time_dilation=1.0)
    timeline.steps += [
        step(start_cpu=0.0, window_cpu=0.001, end_cpu=0.001, modelled_s=0.010),  # host fits the window
        step(start_cpu=0.003, window_cpu=0.015, end_cpu=0.018, modelled_s=0.010),  # 5 ms past it
        step(start_cpu=0.0185, window_cpu=0.002, end_cpu=0.0205, modelled_s=0.010),
    ]
    assert timeline.gap_cpu_s() == pytest.approx(0.002 + 0.0005)
    assert timeline.overrun_cpu_s() == pytest.approx(0.005)
    assert timeline.exposed_host_cpu_s() == pytest.approx(0.0075)
    assert timeline.modelled_s() == pytest.approx(0.030)
    dilated = DeviceTimeline(time_dilation=2.0, steps=timeline.steps)  # windows twice as long
    assert dilated.overrun_cpu_s() == 0.0


# The Serve part's runs, given (it needs its own Ray cluster; `python -m benchmarks.hostpath
# --quick` runs it): the default front door (direct ingress), and Serve's proxies at three
# times its CPU with the same wall and device time.
GIVEN = [
    ServeRun(64, 4, False, 256, 0.5, 0.4, {"proxy": 0.001, "ingress": 0.002, "worker": 0.003}, 0.01, 0),
    ServeRun(64, 4, True, 256, 0.5, 0.4, {"proxy": 0.010, "ingress": 0.020, "worker": 0.010}, 0.01, 0),
    ServeRun(256, 2, False, 512, 0.5, 0.45, {"proxy": 0.002, "ingress": 0.002, "worker": 0.004}, 0.01, 0),
    ServeRun(256, 2, True, 512, 0.5, 0.45, {"proxy": 0.020, "ingress": 0.020, "worker": 0.010}, 0.01, 0),
]
NUMBER = r"[0-9.]+"


def scaled(runs: list[ServeRun], factor: float) -> list[ServeRun]:
    """`runs` with every process's CPU times `factor`."""
    return [ServeRun(r.num_requests, r.max_tokens, r.stream, r.tokens, r.wall_s, r.device_s,
                     {k: factor * v for k, v in r.cpu_s.items()}, r.daemon_cpu_s, 0) for r in runs]


def given_serve(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, bool]]:
    """Stands in for measure_serve: the floor at twice the CPU of its side, on either front
    door; returns the calls it gets (direct_ingress, serve_defaults, floor), in order."""
    monkeypatch.setattr(hostpath, "QUICK_BATCHES", ((64, 4), (256, 2)))  # the same batches, fewer tokens
    calls: list[dict[str, bool]] = []

    def measure_serve(batches: object, repeats: int, direct_ingress: bool = True, serve_defaults: bool = False,
                      floor: bool = False) -> dict[str, list[ServeRun]]:
        calls.append({"direct_ingress": direct_ingress, "serve_defaults": serve_defaults, "floor": floor})
        runs = GIVEN if direct_ingress else scaled(GIVEN, 3.0)
        return {"hostpath": runs, **({"floor": scaled(runs, 2.0)} if floor else {})}

    monkeypatch.setattr(hostpath, "measure_serve", measure_serve)
    return calls


def test_quick_run_prints_the_result_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine part runs for real (fewer tokens); the Serve part's runs are given, to pin
    the report: serve_* through the default front door, proxy_* through Serve's proxies."""
    calls = given_serve(monkeypatch)
    result = (rf"RESULT serve_us_per_token_stream=117 serve_us_per_token=18 delivered_ratio_b64=0.800 "
              rf"delivered_ratio_b256=0.900 engine_host_pct_b256={NUMBER} engine_host_pct_b64={NUMBER} "
              rf"engine_delivered_ratio_b64={NUMBER} engine_delivered_ratio_b256={NUMBER} "
              rf"delivered_vs_engine_b64={NUMBER} delivered_vs_engine_b256={NUMBER}")
    assert hostpath.main(["--quick"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(result, last), last
    assert calls == [{"direct_ingress": True, "serve_defaults": False, "floor": False}]

    calls.clear()
    assert hostpath.main(["--quick", "--serve-floor"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(result + " floor_us_per_token_stream=234 floor_us_per_token=36 floor_delivered_ratio_b64=0.800 "
                        rf"floor_delivered_ratio_b256=0.900 floor_delivered_vs_engine_b64={NUMBER} "
                        rf"floor_delivered_vs_engine_b256={NUMBER}", out[-1]), out[-1]
    assert "against the bare Serve floor: 18 / 36 us/token not streamed (0.50x), 117 / 234 streamed (0.50x)" in "\n".join(out)
    assert calls == [{"direct_ingress": True, "serve_defaults": False, "floor": True}]

    calls.clear()
    assert hostpath.main(["--quick", "--serve-floor", "--serve-proxy"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    # Serve's proxies: 3 x 0.090 s over 768 tokens streamed = 352 us, 3 x 0.014 s = 55 not;
    # their floor twice that.
    assert re.fullmatch(result + " proxy_us_per_token_stream=352 proxy_us_per_token=55 proxy_delivered_ratio_b64=0.800 "
                        rf"proxy_delivered_ratio_b256=0.900 proxy_delivered_vs_engine_b64={NUMBER} "
                        rf"proxy_delivered_vs_engine_b256={NUMBER} floor_us_per_token_stream=234 floor_us_per_token=36 "
                        rf"floor_delivered_ratio_b64=0.800 floor_delivered_ratio_b256=0.900 "
                        rf"floor_delivered_vs_engine_b64={NUMBER} floor_delivered_vs_engine_b256={NUMBER} "
                        "proxy_floor_us_per_token_stream=703 proxy_floor_us_per_token=109 "
                        "proxy_floor_delivered_ratio_b64=0.800 proxy_floor_delivered_ratio_b256=0.900 "
                        rf"proxy_floor_delivered_vs_engine_b64={NUMBER} proxy_floor_delivered_vs_engine_b256={NUMBER}",
                        out[-1]), out[-1]
    text = "\n".join(out)
    assert ("Serve's proxies against the default: 55 / 18 us/token not streamed (3.00x), "
            "352 / 117 streamed (3.00x)") in text
    assert ("Serve's proxies against the bare Serve floor through them: 55 / 109 us/token not streamed (0.50x), "
            "352 / 703 streamed (0.50x)") in text
    # The default path first, then Serve's proxies, each beside its floor.
    assert calls == [{"direct_ingress": True, "serve_defaults": False, "floor": True},
                     {"direct_ingress": False, "serve_defaults": False, "floor": True}]


def test_serve_defaults_run_through_serves_proxies(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Direct ingress is part of Serve's throughput-optimized mode: Serve's defaults are
    measured through its proxies, first, and the default path and Serve's proxies are each
    printed against them."""
    calls = given_serve(monkeypatch)
    assert hostpath.main(["--quick", "--serve-defaults", "--serve-proxy"]) == 0
    text = capsys.readouterr().out
    assert calls == [{"direct_ingress": False, "serve_defaults": True, "floor": False},
                     {"direct_ingress": True, "serve_defaults": False, "floor": False},
                     {"direct_ingress": False, "serve_defaults": False, "floor": False}]
    # The stand-in gives Serve's defaults the proxies' runs: the default path costs a third.
    assert "against Serve's defaults: 18 / 55 us/token not streamed (0.33x), 117 / 352 streamed (0.33x)" in text
    assert "Serve's proxies against Serve's defaults: 55 / 55 us/token not streamed (1.00x)" in text
    with pytest.raises(ValueError, match="direct_ingress=False"):
        measure_serve((), 1, direct_ingress=True, serve_defaults=True)


def test_write_serving_cost_puts_the_default_path_on_top(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """--write-serving-cost: the default path's CPU per token per kind at the top level of
    the file, Serve's proxies' under serve_proxy when --serve-proxy measured them."""
    given_serve(monkeypatch)
    path = tmp_path / "cost.json"
    assert hostpath.main(["--quick", "--serve-proxy", "--write-serving-cost", str(path)]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    cost = ServingCost.load(path)
    # Streamed: proxy 0.030, ingress 0.040, worker 0.020 CPU seconds over 768 tokens.
    assert cost.streamed == pytest.approx({"proxy": 0.030 / 768, "ingress": 0.040 / 768, "worker": 0.020 / 768})
    assert cost.plain == pytest.approx({"proxy": 0.003 / 768, "ingress": 0.004 / 768, "worker": 0.007 / 768})
    proxy = cost.path(serve_proxy=True)
    assert proxy.streamed == pytest.approx({kind: 3 * v for kind, v in cost.streamed.items()})
    assert proxy.plain == pytest.approx({kind: 3 * v for kind, v in cost.plain.items()})
    assert cost.source.startswith("python -m benchmarks.hostpath --quick --serve-proxy, ")
    assert hostpath.main(["--quick", "--write-serving-cost", str(path)]) == 0
    assert ServingCost.load(path).serve_proxy is None


def test_a_serve_run_reports_cpu_per_token_and_the_delivered_share() -> None:
    run = ServeRun(64, 256, True, 16_384, 4.0, 2.0, {"proxy": 0.5, "ingress": 1.0, "worker": 0.138}, 0.3, 0)
    assert run.us_per_token == pytest.approx(1e6 * 1.638 / 16_384)
    assert run.device_rate == 8192.0 and run.delivered_rate == 4096.0 and run.delivered_ratio == 0.5
    # Not streamed, against an engine that alone makes 16384 tok/s on this batch: a quarter of it.
    plain = ServeRun(64, 256, False, 16_384, 4.0, 2.0, {"worker": 0.1}, 0.3, 0)
    assert delivered_vs_engine([run, plain], 64, 16384.0) == 0.25


def test_decode_ahead_benchmark_reports_every_side(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/decode_ahead.py on small batches: the three sides run, and the RESULT line names them."""
    from benchmarks import decode_ahead

    monkeypatch.setattr(hostpath, "BATCHES", ((64, 4), (256, 2)))
    assert decode_ahead.main(["--repeats", "2"]) == 0
    out = capsys.readouterr().out
    for side in ("launch ahead", "plan ahead", "neither"):
        assert out.count(f"b256 {side}") == 2
    result = dict(kv.split("=") for kv in out.strip().splitlines()[-1].removeprefix("RESULT ").split())
    assert set(result) == {f"{k}{s}" for k in ("host_pct_b256", "host_pct_b64", "delivered_ratio_b256",
                                                "delivered_ratio_b64") for s in ("", "_plan_only", "_without")}
    assert all(float(v) > 0 for v in result.values())
