"""Soak: a steady mixed load for M minutes, then checks that nothing leaked.

    python -m benchmarks.soak --minutes 10            # starts a local Ray cluster + app
    python -m benchmarks.soak --minutes 1 --workers 2 --concurrency 8

The load (each client loops until time is up): streaming completions read to the end,
non-streaming completions, chat completions, streams the client drops after a few chunks
(a disconnect: the engine must abort them), non-streaming requests the client gives up
on (a client timeout: an abort). At the end, once the workers are idle:

- leaked_blocks: KV blocks not free on any worker replica (free counts evictable cached
  blocks, so this is 0 unless a request's blocks were never given back);
- rss_growth_mb: growth of the worker replicas' RSS from after the warm-up to the end;
- errors: responses that are neither a success, an explained overload (429), nor a
  disconnect the client made itself.

Last line: `RESULT requests=<n> errors=<e> leaked_blocks=<b> rss_growth_mb=<m>`.
The CI version (tests/integration/test_soak.py) calls `run_soak` on the session cluster.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks import serve_cluster

RSS_BOUND_MB = 64.0


@dataclass
class StreamResult:
    status: int
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    error: dict[str, Any] | None = None  # an error event inside a 200 stream
    completion_tokens: int | None = None


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    max_chunks: int | None = None,
    on_chunk: Callable[[int], None] | None = None,
) -> StreamResult:
    """POST a streaming completion and read its SSE events; `max_chunks` drops the
    connection after that many chunks (a client that goes away); `on_chunk(n)` after the
    n-th chunk."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            try:
                error = response.json()
            except ValueError:
                error = {"raw": response.text[:200]}
            return StreamResult(response.status_code, error=error)
        result = StreamResult(200)
        num_chunks = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                result.error = event["error"]
                continue
            if event.get("usage"):
                result.completion_tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                result.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                logprobs = choice.get("logprobs")
                if logprobs and logprobs.get("tokens"):
                    result.tokens += logprobs["tokens"]
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
            num_chunks += 1
            if on_chunk is not None:
                on_chunk(num_chunks)
            if max_chunks is not None and num_chunks >= max_chunks:
                break  # leaving the context manager closes the connection
        return result


@dataclass
class LoadStats:
    requests: int = 0
    ok: int = 0
    overloaded: int = 0  # 429: explained
    disconnects: int = 0  # the client left on purpose: explained
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 10:
            self.error_samples.append(what)


async def mixed_client(
    client: httpx.AsyncClient, root: str, model: str, deadline: float, stats: LoadStats, rng: random.Random
) -> None:
    """One client's loop: a random kind of request at a time, until the deadline."""
    completions, chat = f"{root}/v1/completions", f"{root}/v1/chat/completions"
    while time.monotonic() < deadline:
        kind = rng.choices(["stream", "plain", "chat", "disconnect", "abort"], weights=[4, 3, 2, 1, 1])[0]
        max_tokens = rng.randint(4, 32)
        prompt = f"Soak request {rng.randint(0, 10**6)}: tell me a short story about"
        stats.requests += 1
        start = time.monotonic()
        try:
            if kind in ("stream", "disconnect"):
                body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.8])}
                result = await stream_completion(client, completions, body, max_chunks=2 if kind == "disconnect" else None)
                if kind == "disconnect" and result.status == 200:
                    stats.disconnects += 1
                    continue
                status, failed = result.status, result.error is not None or (result.status == 200 and result.finish_reason is None)
            elif kind == "abort":
                body = {"model": model, "prompt": prompt, "max_tokens": 64}
                try:
                    response = await client.post(completions, json=body, timeout=0.05)
                    status, failed = response.status_code, False
                except httpx.TimeoutException:
                    stats.disconnects += 1
                    continue
            else:
                url, body = (
                    (completions, {"model": model, "prompt": prompt, "max_tokens": max_tokens})
                    if kind == "plain"
                    else (chat, {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens})
                )
                response = await client.post(url, json=body)
                status, failed = response.status_code, False
        except (httpx.TransportError, json.JSONDecodeError) as e:
            stats.error(f"{kind}: {type(e).__name__}: {e}")
            continue
        if status == 429:
            stats.overloaded += 1
        elif status == 200 and not failed:
            stats.ok += 1
            stats.latencies_s.append(time.monotonic() - start)
        else:
            stats.error(f"{kind}: status {status}")


async def run_load(root: str, model: str, duration_s: float, concurrency: int, seed: int = 0) -> LoadStats:
    stats = LoadStats()
    deadline = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
        await asyncio.gather(*(mixed_client(client, root, model, deadline, stats, random.Random(seed + i)) for i in range(concurrency)))
    return stats


# -- the workers: KV stats and RSS ----------------------------------------------------------
def replica_pids(app_name: str, deployment: str = "worker") -> list[int]:
    """PIDs of the deployment's replica processes on this machine (Ray sets their title to
    `ray::ServeReplica:<app>:<deployment>`)."""
    import psutil

    title = f"ServeReplica:{app_name}:{deployment}"
    pids = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info.get("cmdline") or [])
        if title in cmdline:
            pids.append(proc.pid)
    return pids


def total_rss_mb(pids: list[int]) -> float:
    import psutil

    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def worker_stats(app_name: str) -> list[dict[str, Any]]:
    """`stats` of every worker replica (Serve's broadcast from this driver)."""
    from ray import serve

    handle = serve.get_deployment_handle("worker", app_name)
    return [r for r in handle.broadcast("stats").results(timeout_s=30, return_exceptions=True) if isinstance(r, dict)]


def wait_idle_and_count_leaks(app_name: str, timeout_s: float = 60.0) -> int:
    """Once every replica has nothing running or waiting: the blocks not free (0 = no leak).
    Aborts land within a step; the stats snapshot follows after the next step, so poll."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = worker_stats(app_name)
        idle = stats and all(s["num_running"] == 0 and s["num_waiting"] == 0 for s in stats)
        leaked = sum(int(s["total_blocks"]) - int(s["free_blocks"]) for s in stats)
        if (idle and leaked == 0) or time.monotonic() > deadline:
            return leaked if idle else max(leaked, 1)
        time.sleep(0.5)


@dataclass
class SoakResult:
    requests: int
    errors: int
    leaked_blocks: int
    rss_growth_mb: float
    load: LoadStats

    def line(self) -> str:
        return (
            f"RESULT requests={self.requests} errors={self.errors} "
            f"leaked_blocks={self.leaked_blocks} rss_growth_mb={self.rss_growth_mb:.1f}"
        )


def run_soak(
    root: str,
    model: str,
    app_name: str,
    minutes: float,
    concurrency: int = 6,
    log: Callable[[str], None] = print,
) -> SoakResult:
    """Warm-up (a tenth of the time, at least 5 s), RSS baseline, the load, then the checks."""
    duration = minutes * 60.0
    warmup = max(5.0, duration / 10)
    asyncio.run(run_load(root, model, warmup, concurrency, seed=10_000))
    pids = replica_pids(app_name)
    rss_before = total_rss_mb(pids)
    log(f"soak: warm; {len(pids)} worker processes, RSS {rss_before:.0f} MB; load for {duration:.0f} s")
    load = asyncio.run(run_load(root, model, duration, concurrency))
    leaked = wait_idle_and_count_leaks(app_name)
    rss_growth = total_rss_mb(pids) - rss_before
    kinds = Counter({"ok": load.ok, "overloaded": load.overloaded, "disconnects": load.disconnects, "errors": load.errors})
    log(f"soak: {dict(kinds)}; error samples: {load.error_samples}")
    return SoakResult(load.requests, load.errors, leaked, rss_growth, load)


# -- standalone: a local cluster of its own ---------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--model", help="model directory (default: the embedded kvserve-tiny)")
    parser.add_argument("--rss-bound-mb", type=float, default=RSS_BOUND_MB)
    args = parser.parse_args(argv)

    from ray import serve

    from cluster.app import build_app
    from cluster.config import KVServeConfig

    app_name, prefix = "soak", "/soak"
    port = serve_cluster.start()
    try:
        model: dict[str, Any] = {"path": args.model} if args.model else {}
        config = KVServeConfig.from_dict({
            "app_name": app_name,
            "route_prefix": prefix,
            "model": model,
            "engine": {"device": "cpu", "dtype": "float32", "num_threads": 1},
            "workers": {"num_replicas": args.workers, "num_cpus": 1},
            "ingress": {"max_queued_requests": max(4, args.concurrency), "num_cpus": 0.5},
        })
        serve.run(build_app(config), name=app_name, route_prefix=prefix)
        result = run_soak(f"http://127.0.0.1:{port}{prefix}", config.model.resolved_name(), app_name, args.minutes, args.concurrency)
    finally:
        serve_cluster.stop()
    ok = result.errors == 0 and result.leaked_blocks == 0 and result.rss_growth_mb < args.rss_bound_mb
    print("soak: PASS" if ok else "soak: FAIL", flush=True)
    print(result.line(), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
