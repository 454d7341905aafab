"""Agentic sessions with tool pauses on simulated H200s: KV kept across the pauses
(kv/retention.py) with the headroom router, against the baseline routers on the same trace.

    python -m benchmarks.agents [--rate R] [--window S]
    python -m benchmarks.agents --rates 16,19,20,21     (a sweep: RESULT at its operating point)

The trace (cluster/workload/sim_kinds.py agentic, closed loop): sessions start as a Poisson
process; each turn re-sends the history (a coding agent's system prompt and tools, then
every tool call it made and every tool result it got) plus the new tool result; turn k+1
is sent a tool pause after turn k's answer ends, the pause drawn log-uniform in
[PAUSE_S]. The answer re-sent is the one the simulated engine gave (cluster/sim/answers.py).
Turns that start before WARMUP_S are warm-up (served, not measured): the measured window
sees sessions in every stage, as a long-running cluster has them.

The cluster: NUM_REPLICAS simulated H200s (llama-3-8b, benchmarks.routing's engine limits),
the device KV shrunk to DEVICE_BLOCKS so that a few minutes of simulation put the
sessions' histories (rate x session lifetime x history) past it, as hours of agent
traffic do past a real H200's; the host tier HOST_SHARE x the device KV (a DGX H200's
host memory per GPU over its device KV, as benchmarks.kv_tiers_sim).

Every row runs the same trace. kvserve: the headroom router, session retention on (TTL
150 s, up to RETAINED_SHARE of the pool), host tier. Peers: the baseline routers (round robin, pow2,
least_kv, SGLang's prefix_affinity, llm-d's sticky) with retention off (LRU eviction, as
vLLM and SGLang evict) at their best settings: each with the same host tier as kvserve (a
host tier only adds hits), prefix_affinity also without it (SGLang's default: HiCache
off), keeping its better row. Ablation: headroom and host tier without retention.
Other clients share the cluster: OTHER_RATE_RPS one-shot requests a second (no session).

A sweep (--rates) runs every row at each load and reports each load's keys; its RESULT
line is the operating point's: the lowest swept load at which the best peer serves less
than SATURATED_SHARE of its measured requests within both SLOs (the load where the
cluster saturates for the best baseline; the highest swept load if it never does). The
point is chosen from the peers' rows alone, the same for every policy.

RESULT keys:
  later_turn_prefix_hit             kvserve's cached share (device or host tier) of the
                                    prompt tokens of measured turns 2+
  agent_ttft_p50_vs_prefix_affinity TTFT p50 of measured turns 2+, kvserve / prefix_affinity
  agent_goodput_vs_best             goodput kvserve / the best peer: measured requests (agent
                                    turns and other clients') that met both SLOs, per second
                                    of the measured window (the same requests in every row)
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass, replace

import numpy as np

from benchmarks.routing.search import collector_paused
from benchmarks.routing.setup import HEADROOM, log, sim_config
from cluster.sim.answers import Answer, engine_answers
from cluster.sim.run import SimResult, simulate
from cluster.sim.setup import SimConfig, SimDevice
from cluster.sim.tiers import SimTierOptions
from cluster.workload.draws import around
from cluster.workload.sim_kinds import SimRequest, make_workload

SEED = 0
NUM_REPLICAS = 2
DEVICE_BLOCKS = 16_384  # 262k tokens a replica
HOST_SHARE = 2.0
PAUSE_S = (1.0, 120.0)
# A coding agent's turn: system prompt and tool schemas, then tool results (file reads,
# command output) and short answers (tool calls).
TURNS = 12
SYSTEM_LEN = 6144
TOOL_RESULT_LEN = 256
ANSWER_LEN = 96
# Turns a second offered (sessions start at RATE_RPS / TURNS a second): the sessions'
# histories are then about what device and host tier hold together.
RATE_RPS = 8.0
WARMUP_S = 200.0
WINDOW_S = 30.0
TTL_S = 150.0  # the longest tool pause (120 s) and a turn: a session not back by then has ended
# A cluster that serves agents mostly keeps most of its pool for their sessions (the default,
# 0.5, leaves half of it to other traffic's LRU).
RETAINED_SHARE = 0.9
OTHER_RATE_RPS = 2.0  # other clients' one-shot requests per second
OTHER_PROMPT_LEN = 4096
OTHER_OUTPUT_LEN = 128
PEERS = ("round_robin", "pow2", "least_kv", "prefix_affinity", "sticky")
OURS = "kvserve (headroom+retention+host)"
# A sweep's operating point: the first load where the best peer falls below this share.
SATURATED_SHARE = 0.95


@dataclass(frozen=True)
class Row:
    name: str
    goodput_rps: float
    later_ttft_p50_s: float
    ttft_p99_s: float
    later_hit: float
    within_share: float
    preemptions: int
    tier_loads: int
    seconds: float

    def line(self) -> str:
        return (f"ROW {self.name:32s} goodput {self.goodput_rps:6.2f} req/s  within-SLO {self.within_share:.3f}  "
                f"turns2+ ttft50 {self.later_ttft_p50_s:7.3f} s  ttft99 {self.ttft_p99_s:7.3f} s  "
                f"later-hit {self.later_hit:.3f}  preempt {self.preemptions:5d}  tier-loads {self.tier_loads:7d}  "
                f"({self.seconds:.0f} s)")


def later_turns(result: SimResult) -> list:
    """Measured records of sessions' turns 2+ that got a first token."""
    return [r for r in result.records if not r.warmup and r.first_token_s is not None and r.error is None
            and r.request_id.startswith("agentic-") and not r.request_id.endswith("-0")]


def within_slo(result: SimResult, config: SimConfig) -> int:
    """Measured requests that finished within both SLOs (TTFT, and time per output token)."""
    ttft, itl = config.slo_ttft_ms / 1000.0, config.slo_itl_ms / 1000.0
    return sum(1 for r in result.ok_records() if r.ttft_s <= ttft and r.tpot_s <= itl)


def row(name: str, config: SimConfig, requests: list[SimRequest], device: SimDevice, window_s: float) -> Row:
    t0 = time.perf_counter()
    with collector_paused():
        result = simulate(replace(config, seed=SEED), requests, device)
    s = result.summary()
    later = later_turns(result)
    prompt = sum(r.num_prompt_tokens for r in later)
    good = within_slo(result, config)
    out = Row(name, good / window_s, statistics.median(r.ttft_s for r in later) if later else math.nan,
              s["ttft_s"]["p99"], sum(r.num_cached_tokens for r in later) / prompt if prompt else 0.0,
              good / len(result.records), s["num_preemptions"], s["num_tier_loaded_blocks"], time.perf_counter() - t0)
    log(out.line())
    return out


def trace(rate: float, window_s: float, answer: Answer) -> list[SimRequest]:
    """Sessions starting through warm-up and window at `rate` / TURNS a second; a turn is
    measured when it is due (its open-loop estimate) within the window, and turns due after
    it are not sent (those sessions end there: a run needs no sessions' tails)."""
    end = WARMUP_S + window_s
    lifetime = TURNS * math.exp((math.log(PAUSE_S[0]) + math.log(PAUSE_S[1])) / 2) * 3  # past most sessions' ends
    kw = {"turns": TURNS, "system_len": SYSTEM_LEN, "turn_len": TOOL_RESULT_LEN, "output_len": ANSWER_LEN,
          "pause_s": PAUSE_S, "warmup_s": WARMUP_S, "answer": answer}
    requests = make_workload("agentic", round(rate * (window_s + lifetime)), rate, SEED, **kw)
    requests = [r for r in requests if r.arrival_s < end] + other_clients(OTHER_RATE_RPS, end)
    return sorted(requests, key=lambda r: (r.arrival_s, r.request_id))


def other_clients(rate: float, end_s: float) -> list[SimRequest]:
    """Requests of other clients sharing the cluster (no session: retrieval, batch jobs,
    one-shot chats): Poisson at `rate`, unique prompts of ~OTHER_PROMPT_LEN tokens (+-50%)."""
    rng = np.random.default_rng(SEED + 1)
    out, t, i = [], 0.0, 0
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= end_s:
            return out
        n = int(around(rng, OTHER_PROMPT_LEN))
        prompt = tuple(int(x) for x in rng.integers(1, 32000, n))
        out.append(SimRequest(f"other-{i}", t, prompt, int(around(rng, OTHER_OUTPUT_LEN)), warmup=t < WARMUP_S))
        i += 1


def ceiling(requests: list[SimRequest], block_size: int) -> float:
    """The share of turns 2+'s prompts a perfect cache could serve: the previous turn's
    prompt and answer, in full blocks, at most the prompt less one token."""
    prev: dict[str, int] = {}
    seen = total = 0
    turns = [r for r in requests if r.session_id is not None]
    for r in sorted(turns, key=lambda r: (r.session_id or "", int(r.request_id.rsplit("-", 1)[1]))):
        turn = int(r.request_id.rsplit("-", 1)[1])
        session = r.session_id or ""
        if turn > 0 and not r.warmup:
            seen += min(prev[session], len(r.prompt_token_ids) - 1) // block_size * block_size
            total += len(r.prompt_token_ids)
        prev[session] = len(r.prompt_token_ids) + r.max_tokens - 1  # the answer's last token is never computed
    return seen / total if total else 0.0


def configs(device_only: SimConfig, device: SimDevice) -> dict[str, SimConfig]:
    assert device_only.num_blocks is not None
    host = int(HOST_SHARE * device_only.num_blocks * device_only.block_size * device.kv_bytes_per_token)
    tiers = SimTierOptions(host_bytes=host)
    off = replace(device_only, session_kv_ttl_s=0.0)
    ours = replace(device_only, session_kv_ttl_s=TTL_S, session_kv_max_share=RETAINED_SHARE, tiers=tiers)
    out = {"kvserve (headroom+retention+host)": ours,
           "ablation: headroom, no retention": replace(off, tiers=tiers)}
    for peer in PEERS:
        peer_config = replace(sim_config(peer, NUM_REPLICAS), num_blocks=DEVICE_BLOCKS, session_kv_ttl_s=0.0)
        if peer == "prefix_affinity":  # SGLang's default engine has no host tier (HiCache off)
            out[peer] = peer_config
        out[f"{peer} +host"] = replace(peer_config, tiers=tiers)
    return out


@dataclass(frozen=True)
class LoadResult:
    rate: float
    rows: dict[str, Row]
    best_peer: Row
    prefix_affinity: Row

    def keys(self) -> str:
        ours = self.rows[OURS]
        return (f"later_turn_prefix_hit={ours.later_hit:.3f} "
                f"agent_ttft_p50_vs_prefix_affinity={ours.later_ttft_p50_s / self.prefix_affinity.later_ttft_p50_s:.3f} "
                f"agent_goodput_vs_best={ours.goodput_rps / self.best_peer.goodput_rps:.3f}")


def run_load(rate: float, window_s: float) -> LoadResult:
    """Every row on one trace at `rate` turns/s."""
    device_only = replace(sim_config(HEADROOM, NUM_REPLICAS), num_blocks=DEVICE_BLOCKS)
    device = SimDevice.from_config(device_only)
    requests = trace(rate, window_s, engine_answers(device))
    log(f"agents: {NUM_REPLICAS} simulated H200s (llama-3-8b) x {DEVICE_BLOCKS} device blocks, host tier "
        f"{HOST_SHARE:g}x; {TURNS} turns a session, system {SYSTEM_LEN}, tool results ~{TOOL_RESULT_LEN}, answers "
        f"~{ANSWER_LEN} tokens, tool pauses log-uniform {PAUSE_S[0]:g}-{PAUSE_S[1]:g} s after each answer; "
        f"{rate:g} turns/s, warm-up {WARMUP_S:g} s, {len(requests)} requests "
        f"({sum(not r.warmup for r in requests)} measured); SLO TTFT {device_only.slo_ttft_ms:g} ms, "
        f"ITL {device_only.slo_itl_ms:g} ms")
    log(f"  later-turn prefix ceiling (previous prompt + answer, full blocks): "
        f"{ceiling(requests, device_only.block_size):.3f}")
    rows = {name: row(name, config, requests, device, window_s)
            for name, config in configs(device_only, device).items()}
    peers = {p: max((r for n, r in rows.items() if n in (p, f"{p} +host")),
                    key=lambda r: (r.goodput_rps, -r.later_ttft_p50_s)) for p in PEERS}
    for p, best in peers.items():
        log(f"  best {p}: {best.name}")
    best_peer = max(peers.values(), key=lambda r: r.goodput_rps)
    pa = peers["prefix_affinity"]
    log(f"  best peer by goodput: {best_peer.name}; prefix_affinity at its best: {pa.name}")
    return LoadResult(rate, rows, best_peer, pa)


def operating_point(loads: list[LoadResult]) -> LoadResult:
    """The lowest load at which the best peer serves less than SATURATED_SHARE within the
    SLOs; the highest load if none."""
    ordered = sorted(loads, key=lambda x: x.rate)
    return next((x for x in ordered if x.best_peer.within_share < SATURATED_SHARE), ordered[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=RATE_RPS, help="turns per second offered")
    parser.add_argument("--rates", help="comma-separated loads (turns/s): a sweep, RESULT at its operating point")
    parser.add_argument("--window", type=float, default=WINDOW_S, help="measured seconds after the warm-up")
    args = parser.parse_args()
    t0 = time.perf_counter()
    rates = [float(x) for x in args.rates.split(",")] if args.rates else [args.rate]
    loads = [run_load(rate, args.window) for rate in rates]
    if len(loads) > 1:
        for x in loads:
            log(f"LOAD {x.rate:g} turns/s: kvserve within-SLO {x.rows[OURS].within_share:.3f}, best peer "
                f"({x.best_peer.name}) {x.best_peer.within_share:.3f}: {x.keys()}")
    point = operating_point(loads)
    if len(loads) > 1:
        log(f"operating point: {point.rate:g} turns/s (the first load where the best peer serves < "
            f"{SATURATED_SHARE:g} within the SLOs)")
    log(f"done in {time.perf_counter() - t0:.0f} s")
    log(f"RESULT {point.keys()}")


if __name__ == "__main__":
    main()
