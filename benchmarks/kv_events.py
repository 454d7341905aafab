"""What the router credits a replica with, from KV events (the exact index) and from the
capped snapshot alone (the routing before issue 29), side by side on one engine.

The real engine core, block pool and report builder over a model-free runner (what a
replica caches depends on its scheduler and pool, not on the model's numbers), driven step
by step: requests from prefix groups (a skewed choice, a tail of their own) churn a pool
smaller than their working set. The replica drains its events every step and snapshots
every `--snapshot-steps` steps; a report goes out every `--report-steps` steps (the stats
period), and one in `--drop-every` never reaches the events router (a missed broadcast:
the gap path). Both routers read the same reports:

    snapshot  the report's prefix_hashes, as the router scored them before KV events
    events    router/routing/kv_index.py's index over the same reports

Per request, before it is added: the leading prompt blocks each view credits, against
what the pool really holds then. phantom: credited blocks the replica no longer holds (the
error issue 29 removes); missing: held blocks not credited. Also the pickled report's size
with and without the events, and the index's time per report.

    python -m benchmarks.kv_events [--quick]
"""
from __future__ import annotations

import argparse
import pickle
import random
import time
from collections.abc import Iterable, Set

from kv.block_hash import hash_full_blocks
from router.routing.kv_index import KVIndex
from tests.support.fake_runner import TOKEN, VOCAB, FakeRunner
from worker.api import SamplingParams
from worker.config import CacheConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.kvcache.event_stream import KVEventStream
from worker.serving.routing_report import build_routing_stats

BLOCK_SIZE = 16
VIEWS = ("snapshot", "events", "per_step")


def leading(hashes: list[int], held: Set[int]) -> int:
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


def prompts(num_requests: int, num_groups: int, prefix_blocks: int, seed: int) -> Iterable[list[int]]:
    rng = random.Random(seed)
    groups = [[rng.randrange(VOCAB) for _ in range(prefix_blocks * BLOCK_SIZE)] for _ in range(num_groups)]
    weights = [1.0 / (g + 1) ** 0.5 for g in range(num_groups)]  # skewed: some prefixes hotter
    for _ in range(num_requests):
        group = rng.choices(groups, weights)[0]
        yield group + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 4) * BLOCK_SIZE + 1)]


def run(args: argparse.Namespace) -> dict[str, float]:
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=4096)
    engine = Engine(scheduler, CacheConfig(block_size=BLOCK_SIZE, num_blocks_override=args.num_blocks),
                    FakeRunner(args.num_blocks, TOKEN), VOCAB)
    stream = KVEventStream(engine.enable_kv_events())
    index = KVIndex()
    per_step = KVIndex()  # every batch as soon as it is drained: what a per-step transport would give
    snapshot: Set[int] = frozenset()
    totals = {"requests": 0, "held": 0, "bytes_snapshot": 0, "bytes_events": 0, "reports": 0, "apply_s": 0.0}
    for name in VIEWS:
        totals[f"phantom_{name}"] = totals[f"missing_{name}"] = 0
    pending = list(prompts(args.requests, args.groups, args.prefix_blocks, args.seed))
    step = 0
    while pending or engine.has_unfinished():
        for _ in range(min(args.arrivals_per_step, len(pending))):
            prompt = pending.pop()
            hashes = hash_full_blocks(prompt, BLOCK_SIZE)[: (len(prompt) - 1) // BLOCK_SIZE]
            truth = leading(hashes, engine.kv.pool.cached.keys())
            views = {"snapshot": snapshot}
            for name, ix in (("events", index), ("per_step", per_step)):
                held = ix.get("r")
                views[name] = held.device if held is not None else set()
            for name, view in views.items():
                credited = leading(hashes, view)
                totals[f"phantom_{name}"] += max(credited - truth, 0)
                totals[f"missing_{name}"] += max(truth - credited, 0)
            totals["held"] += truth
            totals["requests"] += 1
            engine.add_request(f"q{totals['requests']}", prompt, SamplingParams(max_tokens=args.max_tokens))
        engine.step()
        step += 1
        batch = stream.drain()
        if batch is not None:
            per_step.apply("r", {"kv_epoch": stream.epoch, "kv_seq": batch.seq, "kv_events": [batch]})
        # Snapshots and reports keep their own clocks on a replica: here half a snapshot
        # period apart, so a report's snapshot is that much older than the report.
        if step % args.snapshot_steps == args.snapshot_steps // 2:
            stream.take_snapshot(engine.kv.cached_block_hashes(args.max_snapshot), [], [])
        if step % args.report_steps == 0:
            report = build_routing_stats(engine, engine.stats(), [], float(step), kv_events=stream.report()).to_dict()
            old = {k: v for k, v in report.items() if not k.startswith("kv_")}
            totals["bytes_events"] += len(pickle.dumps(report))
            totals["bytes_snapshot"] += len(pickle.dumps(old))
            totals["reports"] += 1
            snapshot = frozenset(report["prefix_hashes"])
            if totals["reports"] % args.drop_every:
                start = time.process_time()
                index.apply("r", report)
                totals["apply_s"] += time.process_time() - start
    totals["gaps"] = index.num_gaps
    totals["evictions"] = engine.kv.pool.num_evictions
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (a CI-sized run)")
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--groups", type=int, default=320)
    parser.add_argument("--prefix-blocks", type=int, default=24)
    parser.add_argument("--num-blocks", type=int, default=6000, help="the pool: over the 4,096-hash snapshot cap")
    parser.add_argument("--max-snapshot", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--arrivals-per-step", type=int, default=2)
    parser.add_argument("--report-steps", type=int, default=20, help="steps per stats period")
    parser.add_argument("--snapshot-steps", type=int, default=10, help="steps per snapshot (half a period)")
    parser.add_argument("--drop-every", type=int, default=10, help="one report in this many misses the events router")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.num_blocks, args.groups = 1000, 1500, 96
    t = run(args)
    n, reports = max(t["requests"], 1), max(t["reports"], 1)
    print(f"requests {t['requests']}, held prefix blocks per request {t['held'] / n:.2f}, pool evictions "
          f"{t['evictions']}, reports {t['reports']} ({t['gaps']} gaps rebuilt)")
    for name in VIEWS:
        size = f", report {t[f'bytes_{name}'] / reports / 1024:.1f} KiB" if f"bytes_{name}" in t else ""
        print(f"{name:>8}: phantom blocks per request {t[f'phantom_{name}'] / n:.3f}, "
              f"missing {t[f'missing_{name}'] / n:.3f}{size}")
    print(f"index: {t['apply_s'] / reports * 1e6:.0f} us per report")
    print(f"RESULT phantom_per_request_snapshot={t['phantom_snapshot'] / n:.3f} "
          f"phantom_per_request_events={t['phantom_events'] / n:.3f} "
          f"missing_per_request_snapshot={t['missing_snapshot'] / n:.3f} "
          f"missing_per_request_events={t['missing_events'] / n:.3f} "
          f"phantom_per_request_per_step={t['phantom_per_step'] / n:.3f} "
          f"report_kib_snapshot={t['bytes_snapshot'] / reports / 1024:.1f} "
          f"report_kib_events={t['bytes_events'] / reports / 1024:.1f} "
          f"index_us_per_report={t['apply_s'] / reports * 1e6:.0f}")


if __name__ == "__main__":
    main()
