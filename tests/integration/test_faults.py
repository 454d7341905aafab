"""Faults on the session Serve cluster, each bounded in time and count, loopback only.

- a worker replica killed (ray.kill) while greedy streams run: every stream completes,
  token-identical to an undisturbed run (request migration); Serve replaces the replica;
  no KV block leaks on the survivors;
- an engine step that raises (a worker whose runner is wrapped by tests/support/fault_runner.py,
  test-only): only that step's request fails, clearly; the next ones are served;
- overload well above capacity for OVERLOAD_S seconds: accepted requests complete, the
  excess gets 429, worker RSS stays flat, latency is back to normal afterwards;
- SIGTERM to `kvserve serve` while a request streams: it finishes, new requests get 503
  meanwhile, the process exits 0.

The `fault_counts` fixture records what was injected and survived; when the module's
tests are done it reports the counts and checks them together (nothing lost, every kill
migrated at least one stream), whatever order the tests ran in.
"""
from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.soak import (
    StreamResult,
    replica_pids,
    run_load,
    stream_completion,
    total_rss_mb,
    wait_idle_and_count_leaks,
    worker_stats,
)
from tests.integration.conftest import free_port
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

APP_NAME = "faults-test"
ROUTE_PREFIX = "/faults-test"
MODEL = "kv-tiny-faults"
MAX_QUEUED = 8
OVERLOAD_S = float(os.environ.get("KVSERVE_OVERLOAD_SECONDS", "60"))  # the issue asks for 60 s
REPO_ROOT = Path(__file__).resolve().parents[2]

FaultCounts = dict[str, int]


@pytest.fixture(scope="module")
def fault_counts(request: pytest.FixtureRequest) -> Iterator[FaultCounts]:
    counts: FaultCounts = {
        "replica_kills": 0, "step_failures": 0, "overload_periods": 0, "sigterms": 0, "requests_lost": 0, "migrations": 0,
    }
    yield counts
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"FAULTS {counts}")
    assert counts["requests_lost"] == 0, counts
    assert counts["migrations"] >= counts["replica_kills"], f"a replica kill migrated no stream: {counts}"


def engine_section() -> dict[str, Any]:
    return {
        "block_size": 16,
        "num_blocks": 96,
        "max_model_len": 1024,
        "max_num_seqs": 16,
        "device": "cpu",
        "dtype": "float32",
        "num_threads": 1,
    }


@dataclass
class App:
    root: str
    model_dir: Path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.tiny_served_model import make_served_model

    return make_served_model(tmp_path_factory.mktemp("faults") / "tiny")


@pytest.fixture(scope="module")
def app(serve_cluster: Any, model_dir: Path) -> Iterator[App]:
    """Two worker replicas of a tiny real model behind one ingress."""
    from ray import serve

    from cluster.app import build_app
    from cluster.config import KVServeConfig

    config = KVServeConfig.from_dict(
        {
            "app_name": APP_NAME,
            "route_prefix": ROUTE_PREFIX,
            "model": {"path": str(model_dir), "served_model_name": MODEL},
            "engine": engine_section(),
            "workers": {"num_replicas": 2, "num_cpus": 1, "health_check_period_s": 1.0},
            "ingress": {"max_queued_requests": MAX_QUEUED, "num_cpus": 0.5, "max_migrations": 2},
            "routing": {"stats_period_s": 0.5},
        }
    )
    serve.run(build_app(config), name=APP_NAME, route_prefix=ROUTE_PREFIX)
    try:
        yield App(f"{serve_cluster.http_url}{ROUTE_PREFIX}", model_dir)
    finally:
        serve.delete(APP_NAME)


def greedy_body(i: int, max_tokens: int) -> dict[str, Any]:
    # Token-id prompts: distinct per stream, no tokenizer in the way.
    return {
        "model": MODEL,
        "prompt": [1, 10 + i, 20 + 2 * i, 30 + 3 * i, 40 + i, 50],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 0,
    }


def worker_replica_ids() -> set[str]:
    return {str(s["replica_id"]) for s in worker_stats(APP_NAME)}


def kill_busiest_worker() -> str:
    """ray.kill the worker replica actor with the most running requests; its replica id."""
    import ray

    stats = worker_stats(APP_NAME)
    victim = max(stats, key=lambda s: s["num_running"])
    assert victim["num_running"] > 0, stats
    replica_id = str(victim["replica_id"])
    names = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{APP_NAME}#worker#") and a["name"].endswith(replica_id)]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)
    return replica_id


def migrations_total(root: str) -> float:
    text = httpx.get(f"{root}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith("kvserve:request_migrations_total{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for_replicas(expected: int, excluded: set[str], timeout_s: float = 180.0) -> set[str]:
    """Until `expected` worker replicas answer, none of them in `excluded` (bounded)."""
    def replaced() -> set[str] | None:
        ids = worker_replica_ids()
        return ids if len(ids) == expected and not ids & excluded else None

    return wait_until(replaced, timeout_s, interval_s=1.0, message=f"{expected} replicas, none of {excluded}")


async def run_streams(root: str, num_streams: int, max_tokens: int, on_progress: Any = None) -> list[StreamResult]:
    async with httpx.AsyncClient(timeout=300.0) as client:
        url = f"{root}/v1/completions"
        return await asyncio.gather(
            *(stream_completion(client, url, greedy_body(i, max_tokens), on_chunk=_progress(on_progress, i)) for i in range(num_streams))
        )


def _progress(on_progress: Any, index: int) -> Any:
    return None if on_progress is None else (lambda _num_chunks: on_progress(index))


def test_replica_killed_mid_stream_streams_migrate_token_identical(app: App, fault_counts: FaultCounts) -> None:
    num_streams, max_tokens = 4, 160
    reference = asyncio.run(run_streams(app.root, num_streams, max_tokens))
    for r in reference:
        assert r.status == 200 and r.error is None and r.finish_reason == "length" and r.completion_tokens == max_tokens
    before = migrations_total(app.root)
    replicas_before = worker_replica_ids()
    assert len(replicas_before) == 2

    async def disturbed() -> tuple[list[StreamResult], str]:
        # Kill once every stream has its first tokens, while all of them still run.
        progress = [0] * num_streams
        started = asyncio.Event()

        def on_chunk(index: int) -> None:
            progress[index] += 1
            if min(progress) >= 3:
                started.set()

        streams = asyncio.create_task(run_streams(app.root, num_streams, max_tokens, on_progress=on_chunk))
        await asyncio.wait_for(started.wait(), 120)
        killed = await asyncio.to_thread(kill_busiest_worker)
        return await streams, killed

    results, killed = asyncio.run(disturbed())
    fault_counts["replica_kills"] += 1
    lost = 0
    for ref, got in zip(reference, results):
        if not (got.status == 200 and got.error is None and got.finish_reason == "length"):
            lost += 1
            continue
        assert got.tokens == ref.tokens and got.text == ref.text  # token-identical, seamless text
        assert got.completion_tokens == max_tokens
    fault_counts["requests_lost"] += lost
    assert lost == 0, [(r.status, r.error) for r in results]
    migrated = migrations_total(app.root) - before
    fault_counts["migrations"] += int(migrated)
    assert migrated >= 1
    # Serve replaces the dead replica; the survivors hold no blocks once idle.
    wait_for_replicas(2, {killed})
    assert wait_idle_and_count_leaks(APP_NAME) == 0
    # And the new set serves as before.
    again = asyncio.run(run_streams(app.root, 2, 16))
    assert [r.tokens for r in again] == [r.tokens[:16] for r in reference[:2]]


def test_overload_answers_429_and_recovers(app: App, fault_counts: FaultCounts) -> None:
    async def latency() -> float:
        async with httpx.AsyncClient(timeout=120.0) as client:
            times = []
            for i in range(3):
                start = time.monotonic()
                r = await client.post(f"{app.root}/v1/completions", json=greedy_body(i, 16))
                assert r.status_code == 200, r.text
                times.append(time.monotonic() - start)
            return statistics.median(times)

    baseline = asyncio.run(latency())
    asyncio.run(run_load(app.root, MODEL, 5.0, 4))  # warm: allocator pools, caches
    pids = replica_pids(APP_NAME)
    assert pids
    rss_before = total_rss_mb(pids)
    load = asyncio.run(run_load(app.root, MODEL, OVERLOAD_S, MAX_QUEUED * 4))
    fault_counts["overload_periods"] += 1
    assert load.errors == 0, load.error_samples
    assert load.overloaded > 0 and load.ok > 0
    assert wait_idle_and_count_leaks(APP_NAME) == 0
    growth = total_rss_mb(pids) - rss_before
    assert growth < 64.0, f"worker RSS grew {growth:.0f} MB"
    after = asyncio.run(latency())
    assert after <= max(3 * baseline, baseline + 2.0), (baseline, after)


def test_engine_step_failure_fails_only_that_step(serve_cluster: Any, model_dir: Path, fault_counts: FaultCounts) -> None:
    from ray import serve

    from cluster.app import INGRESS_DEPLOYMENT, WORKER_DEPLOYMENT, ingress_options, ingress_settings, worker_options
    from cluster.config import KVServeConfig
    from router.frontend.ingress import Ingress
    from tests.integration.failing_worker import FailingStepWorker

    name, prefix = "faults-step", "/faults-step"
    config = KVServeConfig.from_dict(
        {
            "app_name": name,
            "route_prefix": prefix,
            "model": {"path": str(model_dir), "served_model_name": MODEL},
            "engine": engine_section(),
            "workers": {"num_replicas": 1, "num_cpus": 1},
            "ingress": {"num_cpus": 0.5},
        }
    )
    options = worker_options(config)
    # The test-only fault hook: a worker whose runner raises on the first engine step, once
    # (it imports tests/, so the replica gets the repository on its path).
    options["ray_actor_options"] = {
        **options["ray_actor_options"],
        "runtime_env": {"env_vars": {"PYTHONPATH": str(REPO_ROOT)}},
    }
    worker = serve.deployment(FailingStepWorker, name=WORKER_DEPLOYMENT).options(**options)
    ingress = serve.deployment(Ingress, name=INGRESS_DEPLOYMENT).options(**ingress_options(config))
    bound_worker = worker.bind(config.engine_config(), fail_on_step=1)
    serve.run(ingress.bind(bound_worker, ingress_settings(config)), name=name, route_prefix=prefix)
    try:
        root = f"{serve_cluster.http_url}{prefix}"
        with httpx.Client(timeout=120.0) as client:
            failed = client.post(f"{root}/v1/completions", json=greedy_body(0, 8))
            fault_counts["step_failures"] += 1
            assert failed.status_code == 500
            message = failed.json()["error"]["message"]
            assert "engine step failed" in message and "injected fault" in message
            for i in range(3):
                ok = client.post(f"{root}/v1/completions", json=greedy_body(i, 8))
                assert ok.status_code == 200, ok.text
                assert ok.json()["choices"][0]["finish_reason"] == "length"
        assert wait_idle_and_count_leaks(name) == 0
    finally:
        serve.delete(name)


def test_sigterm_drains_then_exits_zero(tmp_path: Path, fault_counts: FaultCounts) -> None:
    """`kvserve serve` (its own local Ray cluster, the embedded tiny model) on free ports."""
    port, grpc_port = free_port(), free_port()
    config = tmp_path / "kvserve.yaml"
    config.write_text(
        "engine: {device: cpu, dtype: float32, num_threads: 1}\n"
        "workers: {num_replicas: 1, num_cpus: 1, drain_timeout_s: 60}\n"
        "ingress: {num_cpus: 0.5}\n"
    )
    log = (tmp_path / "serve.log").open("w")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--config", str(config), "--port", str(port), "--grpc-port", str(grpc_port), "--num-cpus", "4"],
        cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    root = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            return httpx.get(f"{root}/health", timeout=5).status_code == 200

        wait_until(healthy, 240, interval_s=1.0, message="kvserve serve to come up", retry_on=(httpx.TransportError,))
        model = httpx.get(f"{root}/v1/models", timeout=30).json()["data"][0]["id"]

        async def scenario() -> tuple[StreamResult, list[int]]:
            first = asyncio.Event()
            statuses: list[int] = []
            # Long enough to outlast the drain's first refusals: with outputs batched per step
            # a few hundred tokens of the tiny model stream in well under a second.
            body = {"model": model, "prompt": "Once upon a time", "max_tokens": 1800, "ignore_eos": True, "temperature": 0.0}
            async with httpx.AsyncClient(timeout=120.0) as client:
                stream = asyncio.create_task(
                    stream_completion(client, f"{root}/v1/completions", body, on_chunk=lambda i: first.set())
                )
                await asyncio.wait_for(first.wait(), 120)
                proc.send_signal(signal.SIGTERM)
                fault_counts["sigterms"] += 1
                # New requests while the stream drains: refused (503), never served.
                while not stream.done() and len(statuses) < 50:
                    try:
                        r = await client.post(f"{root}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})
                        statuses.append(r.status_code)
                    except httpx.TransportError:
                        statuses.append(-1)
                    await asyncio.sleep(0.2)
                return await stream, statuses

        result, statuses = asyncio.run(scenario())
        assert result.status == 200 and result.error is None and result.finish_reason == "length", result
        # Requests that arrive in the moment between the signal and the drain may still be
        # served (200); from the first refusal on, every new request is refused.
        assert 503 in statuses, statuses
        refused = statuses[statuses.index(503) :]
        assert all(s in (503, -1) for s in refused), statuses
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
