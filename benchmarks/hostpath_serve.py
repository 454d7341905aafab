"""The Serve path at device speed: what the serving layer costs per token, and what share
of the device's token rate reaches HTTP clients (benchmarks/hostpath.py runs it).

One worker replica on `sim:h200` (llama-3-8b shape, time dilation 1: every modelled second
is a wall second, so host cost is not hidden), max_num_seqs 256, behind the real Serve app
cluster/app.py builds, served as `kvserve serve` serves it by default: Serve's direct
ingress (HAProxy -> ingress -> worker), or with `direct_ingress=False` as `kvserve serve
--serve-proxy` does (Serve's HTTP proxy -> ingress -> worker). N requests at once to
/v1/completions, token-id prompts of 128 distinct tokens, ignore_eos, streamed (SSE) or not.

- delivered rate = output tokens / wall seconds from the first request sent to the last
  response complete; device rate = output tokens / the device seconds the worker's
  steps modelled over the same run (its `modelled_device_s` stat, read before and after);
  delivered ratio = delivered / device rate (1.0: the serving layer never held the device
  back).
- serving CPU per token = CPU seconds (user + system, psutil) of the Serve processes that
  carry requests (the front door: HAProxy or Serve's HTTP proxy, counted as "proxy"; the
  ingress replica; the worker replica, the engine's own host work included) over the run /
  output tokens. CPU time, not wall time: other load on the box
  stretches wall time but not the CPU the same work needs. Ray's own daemons (GCS, raylet,
  Serve controller) are printed beside it, not counted.

The load client runs in its own process at a lower priority (nice 5): its CPU is not in
any Serve process, and the server it measures comes first. It is aiohttp, whose parser is
C, and parses only what it needs to count tokens (the usage of each response); its own
CPU seconds are printed beside each run, not counted.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.serve_env import THROUGHPUT_OPTIMIZED_ENV, controller_options, job_runtime_env

APP_NAME = "hostpath"
FLOOR_APP_NAME = "floor"  # benchmarks/serve_floor.py, beside kvserve's app when asked for
MODEL = "hostpath-sim"
PROMPT_LEN = 128
REPO_ROOT = Path(__file__).resolve().parents[1]
# The load client's priority: below the server's, so that it cannot starve it, but not so
# low that the server's work starves the client and the offered load trickles in.
CLIENT_NICE = 5


@dataclass(frozen=True)
class ServeRun:
    num_requests: int
    max_tokens: int
    stream: bool
    tokens: int
    wall_s: float
    device_s: float
    cpu_s: dict[str, float]  # per Serve process kind, over the run
    daemon_cpu_s: float  # Ray's daemons over the run (not counted)
    errors: int
    client_cpu_s: float = 0.0  # the load client's own (not counted)

    @property
    def serving_cpu_s(self) -> float:
        return sum(self.cpu_s.values())

    @property
    def us_per_token(self) -> float:
        return 1e6 * self.serving_cpu_s / max(self.tokens, 1)

    @property
    def device_rate(self) -> float:
        return self.tokens / self.device_s if self.device_s > 0 else 0.0

    @property
    def delivered_rate(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def delivered_ratio(self) -> float:
        return self.delivered_rate / self.device_rate if self.device_rate > 0 else 0.0

    def line(self) -> str:
        where = ", ".join(f"{k} {v:.2f} s" for k, v in sorted(self.cpu_s.items()))
        return (f"serve b{self.num_requests} x {self.max_tokens} {'streamed' if self.stream else 'not streamed'}: "
                f"{self.tokens} tokens in {self.wall_s:.2f} s = {self.delivered_rate:.0f} tok/s delivered, device "
                f"{self.device_rate:.0f} tok/s ({self.device_s:.2f} s modelled): ratio {self.delivered_ratio:.3f}; "
                f"serving CPU {self.serving_cpu_s:.2f} s = {self.us_per_token:.0f} us/token ({where}); "
                f"Ray daemons {self.daemon_cpu_s:.2f} s, load client {self.client_cpu_s:.2f} s; errors {self.errors}")


# -- the app ------------------------------------------------------------------------------------
def app_config() -> Any:
    from cluster.config import KVServeConfig

    return KVServeConfig.from_dict({
        "app_name": APP_NAME, "route_prefix": f"/{APP_NAME}",
        "model": {"served_model_name": MODEL},
        "engine": {"device": "sim:h200", "model_shape": "llama-3-8b", "time_dilation": 1.0,
                   "max_num_seqs": 256, "max_model_len": 4096},
        "workers": {"num_replicas": 1, "num_cpus": 0.1},
        "ingress": {"num_replicas": 1, "num_cpus": 0.1, "api_keys_env": None, "max_queued_requests": 1024},
    })


def start(port: int, direct_ingress: bool = True, floor: bool = False) -> dict[str, str]:
    """Ray, Serve and the app; app name -> its completions URL. `direct_ingress`: as
    `kvserve serve` runs it by default (cluster/serve_env.py DirectIngress: HAProxy in front
    of the ingress replicas, which serve HTTP themselves; no Serve proxy hop), on free
    ports; False: as `kvserve serve --serve-proxy` runs it, through Serve's HTTP proxy.
    `floor`: the bare Serve app of benchmarks/serve_floor.py too, as a second app of the
    same Serve instance (its own replicas behind the same front door), so that runs of the
    two can alternate."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from ray import serve
    from ray.serve.config import HTTPOptions

    from cluster.app import build_app
    from cluster.local_ray import start_local_ray
    from cluster.serve_env import DirectIngress

    direct = DirectIngress(free_port(), free_port(), free_port(), free_port()) if direct_ingress else None
    start_local_ray(num_cpus=4, include_dashboard=False, log_to_driver=False,
                    runtime_env=job_runtime_env({"PYTHONPATH": str(REPO_ROOT), "RAY_AUTH_MODE": "disabled"},
                                                direct_ingress=direct))
    serve.start(http_options=HTTPOptions(host="127.0.0.1", port=port),
                controller_options=controller_options(direct_ingress=direct))
    serve.run(build_app(app_config()), name=APP_NAME, route_prefix=f"/{APP_NAME}")
    apps = [APP_NAME]
    if floor:
        from benchmarks.serve_floor import build_floor_app

        serve.run(build_floor_app(), name=FLOOR_APP_NAME, route_prefix=f"/{FLOOR_APP_NAME}")
        apps.append(FLOOR_APP_NAME)
    return {app: f"http://127.0.0.1:{port}/{app}/v1/completions" for app in apps}


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def modelled_device_s(app: str = APP_NAME) -> float:
    from ray import serve

    handle = serve.get_deployment_handle("worker", app)
    stats = handle.broadcast("stats").results(timeout_s=30)
    return sum(float(s.get("modelled_device_s", 0.0)) for s in stats)


# -- CPU of the Serve processes -------------------------------------------------------------------
def process_kinds(app: str = APP_NAME) -> dict[int, str]:
    """pid -> "proxy" | "ingress" | "worker" for the processes that carry `app`'s requests,
    "daemon" for Ray's own (gcs_server, raylet, the Serve controller). Only this driver's
    own cluster (its descendants): other Ray clusters on the machine are not measured, nor
    another app's replicas."""
    import psutil

    kinds = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(proc.cmdline())
            name = proc.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if f"ServeReplica:{app}:ingress" in cmdline:
            kinds[proc.pid] = "ingress"
        elif f"ServeReplica:{app}:worker" in cmdline:
            kinds[proc.pid] = "worker"
        elif "ProxyActor" in cmdline or "haproxy" in name:
            kinds[proc.pid] = "proxy"
        elif any(daemon in cmdline for daemon in ("gcs_server", "raylet", "ServeController")):
            kinds[proc.pid] = "daemon"
    return kinds


def cpu_seconds(kinds: dict[int, str]) -> dict[int, float]:
    """pid -> user + system CPU seconds, for those of `kinds` still running."""
    import psutil

    out: dict[int, float] = {}
    for pid in kinds:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        out[pid] = t.user + t.system
    return out


def cpu_spent(kinds: dict[int, str], before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """CPU seconds per kind between two readings, over the processes alive at both."""
    spent: dict[str, float] = {}
    for pid in before.keys() & after.keys():
        spent[kinds[pid]] = spent.get(kinds[pid], 0.0) + after[pid] - before[pid]
    return spent


# -- the load client (its own process) --------------------------------------------------------------
def client_command(url: str, num_requests: int, max_tokens: int, stream: bool, seed: int) -> list[str]:
    return ["nice", "-n", str(CLIENT_NICE), sys.executable, "-m", "benchmarks.hostpath_serve", "--client", url,
            str(num_requests), str(max_tokens), "1" if stream else "0", str(seed)]


def run_client(url: str, num_requests: int, max_tokens: int, stream: bool, seed: int) -> dict[str, Any]:
    proc = subprocess.run(client_command(url, num_requests, max_tokens, stream, seed), cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"load client failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


async def _client(url: str, num_requests: int, max_tokens: int, stream: bool, seed: int) -> dict[str, Any]:
    """aiohttp (its HTTP parser is C): at 256 requests at once httpx's client spent more
    CPU than the whole server, and on a 2-core box that CPU and its late reads stretched
    the wall time measured here."""
    import aiohttp

    async def one(session: aiohttp.ClientSession, i: int) -> int:
        base = (seed * 100_003 + i * PROMPT_LEN) % 30_000 + 100
        body: dict[str, Any] = {"model": MODEL, "prompt": list(range(base, base + PROMPT_LEN)), "max_tokens": max_tokens,
                                "temperature": 0.0, "ignore_eos": True, "stream": stream}
        if not stream:
            async with session.post(url, json=body) as response:
                response.raise_for_status()
                return int((await response.json())["usage"]["completion_tokens"])
        body["stream_options"] = {"include_usage": True}
        tokens = 0
        async with session.post(url, json=body) as response:
            response.raise_for_status()
            async for raw in response.content:  # one SSE line per item
                if raw.startswith(b"data: {") and b'"usage"' in raw:
                    usage = json.loads(raw[6:]).get("usage")
                    if usage:
                        tokens = int(usage["completion_tokens"])
        return tokens

    connector = aiohttp.TCPConnector(limit=num_requests + 8)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600.0)) as session:
        start, cpu_start = time.perf_counter(), time.process_time()
        results = await asyncio.gather(*(one(session, i) for i in range(num_requests)), return_exceptions=True)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    errors = [r for r in results if isinstance(r, BaseException)]
    return {"tokens": sum(r for r in results if isinstance(r, int)), "wall_s": wall, "client_cpu_s": cpu,
            "errors": len(errors), "error_sample": repr(errors[0])[:300] if errors else ""}


# -- one measured run ---------------------------------------------------------------------------------
def measure(url: str, num_requests: int, max_tokens: int, stream: bool, seed: int, app: str = APP_NAME) -> ServeRun:
    kinds = process_kinds(app)
    device_before = modelled_device_s(app)
    cpu_before = cpu_seconds(kinds)
    result = run_client(url, num_requests, max_tokens, stream, seed)
    cpu_after = cpu_seconds(kinds)
    device_after = modelled_device_s(app)
    spent = cpu_spent(kinds, cpu_before, cpu_after)
    daemon = spent.pop("daemon", 0.0)
    if result["errors"]:
        print(f"  {result['errors']} errors, e.g. {result['error_sample']}", flush=True)
    return ServeRun(num_requests, max_tokens, stream, int(result["tokens"]), float(result["wall_s"]),
                    device_after - device_before, spent, daemon, int(result["errors"]), float(result["client_cpu_s"]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the runs, and what they add up to ----------------------------------------------------------
def measure_serve(batches: tuple[tuple[int, int], ...], repeats: int, direct_ingress: bool = True,
                  serve_defaults: bool = False, floor: bool = False) -> dict[str, list[Any]]:
    """Each batch streamed and not, `repeats` times, the order alternating per repeat, on one
    Serve instance; app name -> its runs. `direct_ingress`: the front door (`start`).
    `serve_defaults`: Serve's own default settings instead of the throughput-optimized mode
    kvserve runs it in (cluster/serve_env.py); direct ingress is part of that mode, so Serve's
    defaults go with Serve's proxies. `floor`: the bare Serve app with the same hops and device
    (benchmarks/serve_floor.py) beside kvserve's, each of its runs next to kvserve's run of
    the same load, which of the two goes first alternating, so that drift over the minutes
    of the run moves both sides alike."""
    if serve_defaults and direct_ingress:
        raise ValueError("Serve's defaults have no direct ingress (it is part of the throughput-optimized mode): "
                         "measure them with direct_ingress=False")
    if serve_defaults:
        os.environ[THROUGHPUT_OPTIMIZED_ENV] = "0"  # the new cluster's processes inherit it
    urls = start(free_port(), direct_ingress, floor)
    runs: dict[str, list[Any]] = {app: [] for app in urls}
    turn = 0
    try:
        for url in urls.values():
            run_client(url, 8, 8, False, 999)  # warm: first-call imports, connections
        for repeat in range(repeats):
            for num_requests, max_tokens in batches:
                for stream in ((False, True) if repeat % 2 == 0 else (True, False)):
                    apps = list(urls) if turn % 2 == 0 else list(reversed(urls))
                    for app in apps:
                        # Prompts of their own per load (the seed): no run reads another's
                        # prompts from the prefix cache.
                        run = measure(urls[app], num_requests, max_tokens, stream, seed=turn, app=app)
                        runs[app].append(run)
                        side = f" {app}" if len(urls) > 1 else ""
                        print(f"  repeat {repeat + 1}/{repeats}{side} {run.line()}", flush=True)
                    turn += 1
    finally:
        stop()
        os.environ.pop(THROUGHPUT_OPTIMIZED_ENV, None)
    return runs


def by_stream(runs: list[Any]) -> tuple[list[Any], list[Any]]:
    """(not streamed, streamed) runs."""
    return [r for r in runs if not r.stream], [r for r in runs if r.stream]


def per_token_us(runs: list[Any]) -> float:
    """Serving CPU over all the runs' tokens (a ratio of sums)."""
    return 1e6 * sum(r.serving_cpu_s for r in runs) / max(sum(r.tokens for r in runs), 1)


def delivered_ratio(runs: list[Any], num_requests: int) -> float:
    """The median delivered ratio of the not-streamed runs of one batch."""
    return statistics.median(r.delivered_ratio for r in runs if r.num_requests == num_requests and not r.stream)


def delivered_vs_engine(runs: list[Any], num_requests: int, engine_rate: float) -> float:
    """The median delivered token rate of one batch's not-streamed runs over the engine
    alone's modelled rate for that batch (all its requests from the first step). Unlike
    the delivered ratio, whose device rate comes from the run's own steps, this also counts
    what the Serve path did to the batch: requests that arrived over several steps, or one
    that waited for the others and then ran alone, make the run's steps more and smaller."""
    return statistics.median(r.tokens / r.wall_s for r in runs
                             if r.num_requests == num_requests and not r.stream) / engine_rate


def versus(label: str, runs: list[Any], other: list[Any]) -> str:
    """`runs` against `other`: CPU per token (and their ratio), delivered ratios, errors."""
    (plain, streamed), (o_plain, o_streamed) = by_stream(runs), by_stream(other)
    return (f"{label}: {per_token_us(plain):.0f} / {per_token_us(o_plain):.0f} us/token not streamed "
            f"({per_token_us(plain) / per_token_us(o_plain):.2f}x), {per_token_us(streamed):.0f} / "
            f"{per_token_us(o_streamed):.0f} streamed ({per_token_us(streamed) / per_token_us(o_streamed):.2f}x); "
            f"delivered ratio b64 {delivered_ratio(runs, 64):.3f} / {delivered_ratio(other, 64):.3f}, "
            f"b256 {delivered_ratio(runs, 256):.3f} / {delivered_ratio(other, 256):.3f}; "
            f"errors {sum(r.errors for r in runs)} / {sum(r.errors for r in other)}")


def result_keys(prefix: str, runs: list[Any], engine_rates: dict[int, float]) -> str:
    """`prefix`'s RESULT keys; `engine_rates`: batch -> the engine alone's modelled rate."""
    plain, streamed = by_stream(runs)
    return (f" {prefix}_us_per_token_stream={per_token_us(streamed):.0f} {prefix}_us_per_token={per_token_us(plain):.0f} "
            f"{prefix}_delivered_ratio_b64={delivered_ratio(runs, 64):.3f} "
            f"{prefix}_delivered_ratio_b256={delivered_ratio(runs, 256):.3f} "
            f"{prefix}_delivered_vs_engine_b64={delivered_vs_engine(runs, 64, engine_rates[64]):.3f} "
            f"{prefix}_delivered_vs_engine_b256={delivered_vs_engine(runs, 256, engine_rates[256]):.3f}")


if __name__ == "__main__" and len(sys.argv) == 7 and sys.argv[1] == "--client":
    _, _, url_arg, n_arg, tokens_arg, stream_arg, seed_arg = sys.argv
    print(json.dumps(asyncio.run(_client(url_arg, int(n_arg), int(tokens_arg), stream_arg == "1", int(seed_arg)))))
