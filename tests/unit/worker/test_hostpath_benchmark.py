"""benchmarks/hostpath.py's engine part: how it counts exposed host time (on synthetic
timelines), and that a quick run ends with its RESULT line. No timing is asserted."""
from __future__ import annotations

import re

import pytest

from benchmarks import hostpath
from benchmarks.hostpath import DeviceStep, DeviceTimeline
from benchmarks.hostpath_serve import ServeRun, delivered_vs_engine


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


def test_quick_run_prints_the_result_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine part runs for real (fewer tokens); the Serve part's runs are given (it
    needs its own Ray cluster; `python -m benchmarks.hostpath --quick` runs it), to pin the report."""
    monkeypatch.setattr(hostpath, "QUICK_BATCHES", ((64, 4), (256, 2)))  # the same batches, fewer tokens
    given = [
        ServeRun(64, 4, False, 256, 0.5, 0.4, {"proxy": 0.001, "ingress": 0.002, "worker": 0.003}, 0.01, 0),
        ServeRun(64, 4, True, 256, 0.5, 0.4, {"proxy": 0.010, "ingress": 0.020, "worker": 0.010}, 0.01, 0),
        ServeRun(256, 2, False, 512, 0.5, 0.45, {"proxy": 0.002, "ingress": 0.002, "worker": 0.004}, 0.01, 0),
        ServeRun(256, 2, True, 512, 0.5, 0.45, {"proxy": 0.020, "ingress": 0.020, "worker": 0.010}, 0.01, 0),
    ]
    # The floor's runs: twice the CPU, the same wall and device time.
    floor_given = [ServeRun(r.num_requests, r.max_tokens, r.stream, r.tokens, r.wall_s, r.device_s,
                            {k: 2 * v for k, v in r.cpu_s.items()}, r.daemon_cpu_s, 0) for r in given]

    def measure_serve(batches: object, repeats: int, floor: bool = False, **_: object) -> dict[str, list[ServeRun]]:
        return {"hostpath": given, **({"floor": floor_given} if floor else {})}

    monkeypatch.setattr(hostpath, "measure_serve", measure_serve)
    number = r"[0-9.]+"
    result = (rf"RESULT serve_us_per_token_stream=117 serve_us_per_token=18 delivered_ratio_b64=0.800 "
              rf"delivered_ratio_b256=0.900 engine_host_pct_b256={number} engine_host_pct_b64={number} "
              rf"engine_delivered_ratio_b64={number} engine_delivered_ratio_b256={number} "
              rf"delivered_vs_engine_b64={number} delivered_vs_engine_b256={number}")
    assert hostpath.main(["--quick"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(result, last), last
    assert hostpath.main(["--quick", "--serve-floor"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(result + " floor_us_per_token_stream=234 floor_us_per_token=36 floor_delivered_ratio_b64=0.800 "
                        rf"floor_delivered_ratio_b256=0.900 floor_delivered_vs_engine_b64={number} "
                        rf"floor_delivered_vs_engine_b256={number}", out[-1]), out[-1]
    assert "against the bare Serve floor: 18 / 36 us/token not streamed (0.50x), 117 / 234 streamed (0.50x)" in "\n".join(out)
    assert hostpath.main(["--quick", "--serve-floor", "--direct-ingress"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.search(r" direct_floor_us_per_token_stream=234 direct_floor_us_per_token=36 "
                     r"direct_floor_delivered_ratio_b64=0.800 direct_floor_delivered_ratio_b256=0.900 "
                     rf"direct_floor_delivered_vs_engine_b64={number} direct_floor_delivered_vs_engine_b256={number}$",
                     last), last


def test_a_serve_run_reports_cpu_per_token_and_the_delivered_share() -> None:
    run = ServeRun(64, 256, True, 16_384, 4.0, 2.0, {"proxy": 0.5, "ingress": 1.0, "worker": 0.138}, 0.3, 0)
    assert run.us_per_token == pytest.approx(1e6 * 1.638 / 16_384)
    assert run.device_rate == 8192.0 and run.delivered_rate == 4096.0 and run.delivered_ratio == 0.5
    # Not streamed, against an engine that alone makes 16384 tok/s on this batch: a quarter of it.
    plain = ServeRun(64, 256, False, 16_384, 4.0, 2.0, {"worker": 0.1}, 0.3, 0)
    assert delivered_vs_engine([run, plain], 64, 16384.0) == 0.25


def test_decode_ahead_benchmark_reports_both_sides(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/decode_ahead.py on small batches: both sides run, and the RESULT line names them."""
    from benchmarks import decode_ahead

    monkeypatch.setattr(hostpath, "BATCHES", ((64, 4), (256, 2)))
    assert decode_ahead.main(["--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("b256 ahead") == 2 and out.count("b256 without") == 2
    result = dict(kv.split("=") for kv in out.strip().splitlines()[-1].removeprefix("RESULT ").split())
    assert set(result) == {f"{k}{s}" for k in ("host_pct_b256", "host_pct_b64", "delivered_ratio_b256",
                                                "delivered_ratio_b64") for s in ("", "_without")}
    assert all(float(v) > 0 for v in result.values())
