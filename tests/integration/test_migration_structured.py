"""A replica killed mid-stream under a JSON schema (issue 48, finding 11): the streams
migrate (router/frontend/migration.py) and each client's whole text is still valid JSON
against the schema. Before the fix the resumed request's grammar started from the root, so
the text after the migration opened a new object and the client's JSON did not parse.

Two worker replicas of the tiny served model behind one ingress; the schema's long string
keeps every stream running while the busiest replica is killed."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from benchmarks.soak import StreamResult, stream_completion, worker_stats

pytestmark = pytest.mark.integration

APP_NAME = "migration-json-test"
ROUTE_PREFIX = "/migration-json-test"
MODEL = "kv-tiny-migration-json"
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000},
        "note": {"type": "string", "minLength": 160, "maxLength": 200},
    },
    "required": ["id", "note"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def root(serve_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from ray import serve

    from cluster.app import build_app
    from cluster.config import KVServeConfig
    from tests.support.tiny_served_model import make_served_model

    model_dir: Path = make_served_model(tmp_path_factory.mktemp("migration-json") / "tiny")
    config = KVServeConfig.from_dict({
        "app_name": APP_NAME,
        "route_prefix": ROUTE_PREFIX,
        "model": {"path": str(model_dir), "served_model_name": MODEL},
        "engine": {"block_size": 16, "num_blocks": 96, "max_model_len": 1024, "max_num_seqs": 16, "device": "cpu",
                   "dtype": "float32", "num_threads": 1},
        "workers": {"num_replicas": 2, "num_cpus": 1, "health_check_period_s": 1.0},
        "ingress": {"max_queued_requests": 8, "num_cpus": 0.5, "max_migrations": 2},
        "routing": {"stats_period_s": 0.5},
    })
    serve.run(build_app(config), name=APP_NAME, route_prefix=ROUTE_PREFIX)
    try:
        yield f"{serve_cluster.http_url}{ROUTE_PREFIX}"
    finally:
        serve.delete(APP_NAME)


def body(i: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": [1, 10 + i, 20 + 2 * i, 30 + 3 * i, 40 + i, 50],
        "max_tokens": 400,
        "temperature": 0.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "note", "schema": SCHEMA}},
    }


def kill_busiest_worker() -> None:
    import ray

    stats = worker_stats(APP_NAME)
    victim = max(stats, key=lambda s: s["num_running"])
    assert victim["num_running"] > 0, stats
    replica_id = str(victim["replica_id"])
    names = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{APP_NAME}#worker#") and a["name"].endswith(replica_id)]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)


def migrations_total(root: str) -> float:
    for line in httpx.get(f"{root}/metrics", timeout=30).text.splitlines():
        if line.startswith("kvserve:request_migrations_total{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_killed_replicas_json_streams_stay_valid_json(root: str) -> None:
    num_streams = 4
    before = migrations_total(root)

    async def disturbed() -> list[StreamResult]:
        progress = [0] * num_streams
        started = asyncio.Event()

        def on_chunk(index: int) -> None:
            progress[index] += 1
            if min(progress) >= 4:  # every stream is inside its object
                started.set()

        async with httpx.AsyncClient(timeout=300.0) as client:
            url = f"{root}/v1/completions"
            streams = asyncio.gather(*(
                stream_completion(client, url, body(i), on_chunk=lambda _n, i=i: on_chunk(i)) for i in range(num_streams)
            ))
            await asyncio.wait_for(started.wait(), 120)
            await asyncio.to_thread(kill_busiest_worker)
            return await streams

    results = asyncio.run(disturbed())
    assert migrations_total(root) - before >= 1
    for r in results:
        assert r.status == 200 and r.error is None and r.finish_reason == "stop", (r.status, r.error, r.text)
        jsonschema.validate(json.loads(r.text), SCHEMA)
