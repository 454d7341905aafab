"""The discrete-event simulator: the real engine on a virtual clock (worker/sim SimRunner
for tokens and step times), routers with stale reports, queues, disaggregation, autoscaling."""
from __future__ import annotations

import pytest

from cluster.sim.autoscale import AutoscaleOptions
from cluster.sim.disagg import DisaggOptions
from cluster.sim.run import simulate
from cluster.sim.setup import SimConfig
from cluster.workload.sim_kinds import SimRequest, make_workload
from worker.costs.cost_model import SeqWork, StepCostModel
from worker.costs.profiles import load_profile
from worker.costs.shapes import load_shape

COST = StepCostModel(load_shape("llama-3-8b"), load_profile("h200"))


def _requests(specs: list[tuple[float, int, int]], base: int = 1) -> list[SimRequest]:
    """(arrival, prompt length, max_tokens) -> requests with distinct token ids."""
    return [SimRequest(f"r{i}", t, tuple(range(base + 1000 * i, base + 1000 * i + n)), m)
            for i, (t, n, m) in enumerate(specs)]


def test_same_seed_gives_identical_json_other_seed_differs() -> None:
    reqs = make_workload("b2b", 120, 30.0, seed=5, num_groups=6, prefix_len=512, question_len=256)
    cfg = SimConfig(num_replicas=3, router="pow2", num_ingress=2, stats_period_s=0.5, seed=5, num_blocks=2000)
    first = simulate(cfg, reqs).to_json()
    assert simulate(cfg, reqs).to_json() == first
    other = SimConfig(num_replicas=3, router="pow2", num_ingress=2, stats_period_s=0.5, seed=6, num_blocks=2000)
    assert simulate(other, reqs).to_json() != first


def test_one_request_on_one_replica_takes_exactly_the_modelled_step_times() -> None:
    prompt, max_tokens = 300, 4
    cfg = SimConfig(num_replicas=1, keep_token_times=True)
    result = simulate(cfg, _requests([(0.25, prompt, max_tokens)]))
    rec = result.records[0]
    prefill = COST.step_time_s([SeqWork(prompt, 0)])  # one chunk: 300 <= max_num_batched_tokens
    assert rec.ttft_s == pytest.approx(prefill, rel=1e-12)
    expected, t = [], 0.25 + prefill
    expected.append(t)
    for k in range(max_tokens - 1):  # each decode reads the whole context so far
        t += COST.step_time_s([SeqWork(1, prompt + k)])
        expected.append(t)
    assert rec.token_times == pytest.approx(expected, rel=1e-12)
    assert rec.finish_s == pytest.approx(expected[-1], rel=1e-12)
    assert rec.num_output_tokens == max_tokens
    s = result.summary()
    assert s["num_finished"] == 1 and s["goodput_rps"] > 0


def test_max_ongoing_requests_queues_at_the_router_until_a_slot_frees() -> None:
    cfg = SimConfig(num_replicas=1, max_ongoing_requests=2)
    result = simulate(cfg, _requests([(0.0, 100, 8), (0.0, 100, 8), (0.001, 100, 8), (0.002, 100, 8), (0.003, 100, 8)]))
    recs = sorted(result.records, key=lambda r: r.request_id)
    assert result.summary()["num_router_queued"] == 3
    finishes = sorted(r.finish_s for r in recs)
    for rec in recs[2:]:  # each queued request was sent the moment an earlier one finished
        assert rec.dispatch_s in finishes
        assert rec.dispatch_s > rec.arrival_s
    # at no time were more than two requests at the replica
    for rec in recs:
        at_replica = [r for r in recs if r.dispatch_s <= rec.dispatch_s < r.finish_s]
        assert len(at_replica) <= 2


def _herd_scenario(router: str) -> tuple[list, object]:
    """Replica A runs a long request; both replicas then report (A looks busier); a burst
    of 12 short requests arrives within 0.1 s, long before the next report."""
    long_request = [(0.0, 2000, 4000)]
    burst = [(21.0 + 0.008 * i, 200, 4) for i in range(12)]
    cfg = SimConfig(num_replicas=2, router=router, stats_period_s=20.0, seed=1)
    result = simulate(cfg, _requests(long_request + burst))
    return result.records, result


def test_stale_reports_without_reservations_herd_a_burst_onto_one_replica() -> None:
    records, result = _herd_scenario("least_kv")
    long_replica = records[0].replica_keys[0]
    burst_replicas = {r.replica_keys[0] for r in records[1:]}
    assert burst_replicas == {1 - long_replica}  # every one to the replica that looked emptiest
    (router,) = result.router_stats
    # the router only ever saw reports at least the delivery lag old; the burst's were ~1-20 s old
    assert router["min_report_age_s"] >= SimConfig().report_lag_s
    assert router["mean_report_age_s"] > 0.5
    # the same burst with reservations counted at dispatch time spreads
    records, _ = _herd_scenario("headroom")
    assert len({r.replica_keys[0] for r in records[1:]}) == 2


def test_disaggregated_request_pays_the_kv_transfer_between_its_first_two_tokens() -> None:
    prompt = 1000
    disagg = DisaggOptions(prefill_replicas=1, decode_replicas=1, link_bandwidth=10e9, link_latency_s=0.002)
    cfg = SimConfig(disagg=disagg, keep_token_times=True)
    result = simulate(cfg, _requests([(0.0, prompt, 3)]))
    rec = result.records[0]
    prefill_key, decode_key = rec.replica_keys
    assert [r.role for r in result.replicas] == ["prefill", "decode"]
    assert (prefill_key, decode_key) == (0, 1)
    transfer = prompt * load_shape("llama-3-8b").kv_bytes_per_token() / 10e9 + 0.002
    assert transfer == disagg.transfer_time_s(prompt, load_shape("llama-3-8b").kv_bytes_per_token())
    assert rec.ttft_s == pytest.approx(COST.step_time_s([SeqWork(prompt, 0)]), rel=1e-12)
    gap = rec.token_times[1] - rec.token_times[0]
    assert gap == pytest.approx(transfer + COST.step_time_s([SeqWork(1, prompt)]), rel=1e-9)
    assert rec.num_output_tokens == 3
    prefill, decode = result.replicas
    assert prefill.engine.num_pinned_blocks == 0  # released once the decode side had it
    assert decode.engine.kv.prefix_cache_queries == 0  # imported, not prefilled there


def test_autoscaling_adds_replicas_after_the_startup_delay_and_drains_without_dropping() -> None:
    opts = AutoscaleOptions(min_replicas=1, max_replicas=3, interval_s=2.0, startup_delay_s=15.0,
                            upscale_delay_s=0.0, downscale_delay_s=4.0)
    # a burst that backs up one replica, a lull, then a trickle (scale down meanwhile)
    reqs = make_workload("sharegpt", 250, 40.0, seed=0) + _requests([(80.0 + 2 * i, 100, 16) for i in range(10)], 100_000)
    cfg = SimConfig(num_replicas=1, max_num_seqs=8, max_ongoing_requests=16, autoscale=opts, seed=0)
    result = simulate(cfg, reqs)
    s = result.summary()
    assert s["num_finished"] == 260 and s["num_rejected"] == 0
    added = result.replicas[1:]
    assert added, "the backlog should have scaled the pool up"
    # every replica that served was ready startup_delay_s after it was asked for
    first_up = min(r.ready_at for r in added if r.ready_at is not None)
    assert first_up >= opts.interval_s + opts.startup_delay_s
    assert (first_up - opts.startup_delay_s) % opts.interval_s == pytest.approx(0.0, abs=1e-9)
    # drained replicas left only after their last request finished
    assert any(r.removed_at is not None for r in added), "the lull after the burst should have drained one"
    for replica in result.replicas:
        if replica.removed_at is not None:
            served = [r for r in result.records if replica.key in r.replica_keys]
            assert all(r.finish_s <= replica.removed_at for r in served)


@pytest.mark.parametrize("kind,floor,kw", [("b2b", 0.5, {"num_groups": 4}), ("agentic", 0.4, {})])
def test_shared_prefixes_hit_the_real_prefix_cache(kind: str, floor: float, kw: dict) -> None:
    reqs = make_workload(kind, 80, 8.0, seed=0, **kw)
    result = simulate(SimConfig(num_replicas=1, max_model_len=32768), reqs)  # agentic histories reach ~16k
    s = result.summary()
    assert s["num_finished"] == 80
    assert s["prefix_cache_hit_rate"] > floor
    assert sum(r.num_cached_tokens for r in result.records) > 0


def test_warmup_requests_load_the_replica_but_no_figure_counts_them() -> None:
    """b2b with a warm-up: every group's prefix is cached before the measured requests
    arrive, so (one replica) every measured request hits its whole prefix; the warm-up
    requests are served but absent from the records and the hit rate."""
    groups, prefix = 6, 512
    reqs = make_workload("b2b", 30, 10.0, seed=3, num_groups=groups, prefix_len=prefix, question_len=64,
                         output_len=8, warmup_s=2.0)
    assert sum(r.warmup for r in reqs) == groups and all(4 <= r.max_tokens <= 12 for r in reqs if r.warmup)
    assert min(r.arrival_s for r in reqs if not r.warmup) >= 2.0 > max(r.arrival_s for r in reqs if r.warmup)
    result = simulate(SimConfig(num_replicas=1), reqs)
    s = result.summary()
    assert s["num_requests"] == s["num_finished"] == 30
    assert all(not r.warmup and r.num_cached_tokens >= prefix for r in result.records)
    prompt = sum(r.num_prompt_tokens for r in result.records)
    assert s["prefix_cache_hit_rate"] == pytest.approx(sum(r.num_cached_tokens for r in result.records) / prompt)
    assert s["duration_s"] <= max(r.finish_s for r in result.records) - 2.0


def test_requests_longer_than_the_model_allows_are_rejected_not_dropped() -> None:
    result = simulate(SimConfig(num_replicas=1, max_model_len=512), _requests([(0.0, 600, 4), (0.0, 100, 4)]))
    s = result.summary()
    assert s["num_rejected"] == 1 and s["num_finished"] == 1
    bad = next(r for r in result.records if r.error)
    assert "max_model_len" in bad.error


@pytest.mark.parametrize("assignment", ["round_robin", "session"])
def test_requests_spread_over_ingress_routers_round_robin_or_by_session(assignment: str) -> None:
    reqs = make_workload("agentic", 48, 20.0, seed=0, turns=4)
    cfg = SimConfig(num_replicas=2, router="round_robin", num_ingress=3, ingress_assignment=assignment,
                    num_blocks=4000)
    result = simulate(cfg, reqs)
    counts = [r["num_dispatched"] for r in result.router_stats]
    assert sum(counts) == 48
    if assignment == "round_robin":
        assert counts == [16, 16, 16]
    else:
        ingress_of = {rec.request_id: rec.ingress for rec in result.records}
        by_session: dict[str, set[int]] = {}
        for request in reqs:
            by_session.setdefault(request.session_id, set()).add(ingress_of[request.request_id])
        assert all(len(routers) == 1 for routers in by_session.values())
        assert len(set().union(*by_session.values())) > 1


def test_reported_prefix_hashes_reach_the_policies() -> None:
    """Prefix affinity sees each replica's cached hashes only through its stale reports;
    with them it keeps a group on one replica and misses less than round robin."""
    reqs = make_workload("b2b", 120, 10.0, seed=0, num_groups=8, prefix_len=512, question_len=256)
    hit = {}
    for router in ("round_robin", "prefix_affinity"):
        cfg = SimConfig(num_replicas=4, router=router, num_blocks=3000, stats_period_s=0.5)
        hit[router] = simulate(cfg, reqs).summary()["prefix_cache_hit_rate"]
    assert hit["prefix_affinity"] > hit["round_robin"] + 0.05


def test_a_policy_that_offers_no_replica_stalls_loudly_instead_of_spinning(monkeypatch) -> None:
    from router.routing import policies

    class NoReplica:  # a broken policy: ranks nothing, ever
        name = "none"

        def rank(self, request, views, now):  # type: ignore[no-untyped-def]
            return []

        def on_dispatch(self, *a) -> None: ...  # type: ignore[no-untyped-def]

        def on_complete(self, *a) -> None: ...  # type: ignore[no-untyped-def]

        def on_report(self, *a) -> None: ...  # type: ignore[no-untyped-def]

    monkeypatch.setattr(policies, "make_policy", lambda name, params=None, seed=0: NoReplica())
    with pytest.raises(RuntimeError, match="stalled"):
        simulate(SimConfig(num_replicas=1, stats_period_s=60.0), _requests([(0.0, 10, 2)]))


def test_a_long_idle_gap_between_arrivals_is_not_a_stall() -> None:
    result = simulate(SimConfig(num_replicas=1, stats_period_s=60.0), _requests([(0.0, 10, 2), (5000.0, 10, 2)]))
    assert result.summary()["num_finished"] == 2


def test_dispatch_latency_delays_routing_and_counts_from_the_arrival() -> None:
    prompt, latency = 300, 0.17
    cfg = SimConfig(num_replicas=1, dispatch_latency_s=latency, keep_token_times=True)
    rec = simulate(cfg, _requests([(0.25, prompt, 2)])).records[0]
    assert rec.arrival_s == 0.25
    assert rec.ttft_s == pytest.approx(latency + COST.step_time_s([SeqWork(prompt, 0)]), rel=1e-12)
    with pytest.raises(ValueError, match="dispatch_latency_s"):
        SimConfig(dispatch_latency_s=-1.0)


def test_dispatch_latency_samples_are_drawn_per_request_and_seeded() -> None:
    """A measured distribution of the path: each request waits one of the samples (seeded)."""
    step = COST.step_time_s([SeqWork(300, 0)])
    reqs = _requests([(10.0 * i, 300, 2) for i in range(12)])  # far apart: no queueing, TTFT = path + one step
    samples = (0.01, 0.2, 0.5)
    cfg = SimConfig(num_replicas=1, dispatch_latency_samples=samples, seed=3)
    ttfts = [rec.ttft_s for rec in sorted(simulate(cfg, reqs).records, key=lambda r: r.arrival_s)]
    drawn = [round(t - step, 9) for t in ttfts]
    assert set(drawn) <= set(samples) and len(set(drawn)) > 1
    assert drawn == [round(rec.ttft_s - step, 9) for rec in sorted(simulate(cfg, reqs).records,
                                                                    key=lambda r: r.arrival_s)]
    with pytest.raises(ValueError, match="dispatch_latency_samples"):
        SimConfig(dispatch_latency_samples=(0.1, -0.1))


def test_policy_options_reach_the_policy_and_unknown_ones_fail() -> None:
    reqs = _requests([(0.0, 64, 2)])
    cfg = SimConfig(num_replicas=2, router="sticky", policy_options=(("prefill_tokens_per_s", 1234.0),))
    from cluster.sim.run import Simulation
    from cluster.sim.setup import SimDevice

    sim = Simulation(cfg, SimDevice.from_config(cfg))
    assert sim.routers[0].policies["mixed"].options.prefill_tokens_per_s == 1234.0
    assert sim.run(reqs).summary()["num_finished"] == 1
    with pytest.raises(ValueError):
        simulate(SimConfig(num_replicas=1, router="round_robin", policy_options=(("target_s", 1.0),)), reqs)


def _multi_ingress_burst(num_ingress: int, shared_view: bool, rtt_s: float = 0.0) -> set[int]:
    """Nine long requests, then (one report later, long before the next: stats period 20 s)
    a burst of 16 within 16 ms through `num_ingress` routers. Returns the replicas the
    burst went to."""
    busy = [(0.0, 3000, 3000)] * 9
    burst = [(5.0 + 0.001 * i, 1500, 50) for i in range(16)]
    cfg = SimConfig(num_replicas=4, router="headroom", num_ingress=num_ingress, shared_view=shared_view,
                    shared_view_rtt_s=rtt_s, stats_period_s=20.0, seed=1, num_blocks=1200)
    result = simulate(cfg, _requests(busy + burst, base=1))
    return {r.replica_keys[0] for r in result.records if int(r.request_id[1:]) >= len(busy)}


def test_private_views_herd_a_multi_ingress_burst_and_a_shared_view_spreads_it() -> None:
    """Each router with a private view sees only its own quarter of the burst promised, so
    all four send theirs to the replica that looked emptiest; sharing one view (what Redis
    does in a deployment) spreads it as one router does."""
    assert len(_multi_ingress_burst(1, False)) == 4
    assert len(_multi_ingress_burst(4, False)) == 1
    assert len(_multi_ingress_burst(4, True)) == 4
    # a shared view whose writes take longer than the whole burst to land is private again
    assert len(_multi_ingress_burst(4, True, rtt_s=0.5)) == 1
    with pytest.raises(ValueError, match="routing view"):
        SimConfig(router="pow2", num_ingress=2, shared_view=True)


def test_late_requests_proving_a_p99_miss_prove_it_whatever_the_others_do() -> None:
    import numpy as np

    from cluster.sim.metrics import late_requests_proving_p99_miss

    for n in range(1, 400):
        k = late_requests_proving_p99_miss(n)
        assert 1 <= k <= n
        ttft = np.array([0.0] * (n - k) + [2.0 + 1e-9] * k)  # the others as fast as can be
        assert np.percentile(ttft, 99) > 2.0
    assert late_requests_proving_p99_miss(1000) == 11


def test_a_run_stopped_at_the_slo_miss_gives_the_full_runs_verdict_sooner() -> None:
    reqs = make_workload("sharegpt", 300, 400.0, seed=3)  # far beyond one replica's capacity
    full = simulate(SimConfig(num_replicas=1, num_blocks=4000, seed=3), reqs)
    stopped = simulate(SimConfig(num_replicas=1, num_blocks=4000, seed=3, stop_at_slo_miss=True), reqs)
    s_full, s_stopped = full.summary(), stopped.summary()
    assert s_full["ttft_s"]["p99"] > 2.0 and not s_full["stopped_at_slo_miss"]
    assert s_stopped["stopped_at_slo_miss"] and s_stopped["ttft_s"]["p99"] > 2.0
    assert s_stopped["num_finished"] < s_stopped["num_requests"] <= 300
    assert stopped.num_events < full.num_events
    # a run that meets the SLO is not cut short
    light = make_workload("sharegpt", 30, 2.0, seed=3)
    assert not simulate(SimConfig(num_replicas=1, num_blocks=4000, seed=3, stop_at_slo_miss=True), light).summary()[
        "stopped_at_slo_miss"]
