"""Helpers for the multi-node tests: where Serve placed each replica, the app configs they
deploy, and greedy streams run side by side."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.soak import StreamResult, stream_completion

MODEL = "tiny-mn"


@dataclass(frozen=True)
class Placement:
    replica_id: str
    node_id: str
    state: str
    actor_name: str


def placements(app_name: str, deployment: str, running_only: bool = True) -> list[Placement]:
    """The deployment's replicas and their nodes, from the Serve controller (the same
    details Serve's dashboard shows; no dashboard needed)."""
    from ray.serve.context import _get_global_client  # test-only: Serve's own client

    details = _get_global_client().get_serve_details()
    app = details["applications"].get(app_name)
    if app is None or deployment not in app["deployments"]:
        return []
    found = [
        Placement(r["replica_id"], r.get("node_id") or "", str(r["state"]), r.get("actor_name") or "")
        for r in app["deployments"][deployment]["replicas"]
    ]
    return [p for p in found if p.state.endswith("RUNNING")] if running_only else found


def engine_section() -> dict[str, Any]:
    return {"block_size": 16, "num_blocks": 96, "max_model_len": 1024, "max_num_seqs": 16,
            "device": "cpu", "dtype": "float32", "num_threads": 1}


def app_config(app_name: str, model_dir: Path, workers: dict[str, Any], ingress: dict[str, Any],
               **sections: Any) -> Any:
    from cluster.config import KVServeConfig

    return KVServeConfig.from_dict({
        "app_name": app_name,
        "route_prefix": f"/{app_name}",
        "model": {"path": str(model_dir), "served_model_name": MODEL},
        "engine": engine_section(),
        "workers": {"num_cpus": 1, "health_check_period_s": 1.0, "health_check_timeout_s": 5.0, **workers},
        "ingress": {"num_cpus": 0.25, "api_keys_env": None, "request_timeout_s": 120, **ingress},
        "routing": {"stats_period_s": 0.5},
        **sections,
    })


def greedy_body(i: int, max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [1, 10 + i, 20 + 2 * i, 30 + 3 * i, 40 + i, 50],
            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}


@dataclass
class Outcome:
    result: StreamResult | None
    transport_error: str | None  # the connection broke (no status, or a cut stream)


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any], on_chunk: Any) -> Outcome:
    try:
        return Outcome(await stream_completion(client, url, body, on_chunk=on_chunk), None)
    except (httpx.TransportError, httpx.StreamError) as e:
        return Outcome(None, f"{type(e).__name__}: {e}")


async def run_streams(urls: list[str], max_tokens: int, started: asyncio.Event | None = None,
                      min_chunks: int = 3, progress: list[int] | None = None) -> list[Outcome]:
    """One greedy stream per URL (stream i gets prompt i); `started` is set once every
    stream has `min_chunks` chunks; `progress[i]` counts stream i's chunks."""
    progress = progress if progress is not None else [0] * len(urls)

    def on_chunk(i: int) -> Any:
        def seen(_n: int) -> None:
            progress[i] += 1
            if started is not None and min(progress) >= min_chunks:
                started.set()
        return seen

    async with httpx.AsyncClient(timeout=120.0) as client:
        return await asyncio.gather(*(
            _one(client, url, greedy_body(i, max_tokens), on_chunk(i)) for i, url in enumerate(urls)
        ))


def completed(o: Outcome, max_tokens: int) -> bool:
    r = o.result
    return (r is not None and r.status == 200 and r.error is None and r.finish_reason == "length"
            and r.completion_tokens == max_tokens)


def migrations_total(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith("kvserve:request_migrations_total{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
