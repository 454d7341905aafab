"""Helpers shared by the bad-input and security tests: deploy the whole kvserve app on a
tiny model (optionally with environment variables for the ingress replica, e.g. API
keys), poll without sleeping blindly, and scan Ray's log files."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tests.support.waiting import wait_until

T = TypeVar("T")

NUM_BLOCKS, BLOCK_SIZE = 32, 16  # 512 tokens of KV: the effective max_model_len


def tiny_config(app_name: str, model_dir: Path, model_name: str, ingress: dict[str, Any] | None = None) -> Any:
    from cluster.config import KVServeConfig

    return KVServeConfig.from_dict(
        {
            "app_name": app_name,
            "route_prefix": f"/{app_name}",
            "model": {"path": str(model_dir), "served_model_name": model_name},
            "engine": {
                "block_size": BLOCK_SIZE,
                "num_blocks": NUM_BLOCKS,
                "max_model_len": 1024,
                "max_num_seqs": 16,
                "device": "cpu",
                "dtype": "float32",
                "num_threads": 1,
            },
            "workers": {"num_replicas": 1, "num_cpus": 1},
            # No API keys unless the test sets them (whatever $KVSERVE_API_KEYS holds here).
            "ingress": {"num_cpus": 0.5, "request_timeout_s": 120, "api_keys_env": None, **(ingress or {})},
            "routing": {"stats_period_s": 0.5},
        }
    )


def deploy(config: Any, ingress_env: dict[str, str] | None = None) -> None:
    """serve.run of cluster.app.build_app's app; `ingress_env` is set in the ingress
    replica's environment only (how the chart passes KVSERVE_API_KEYS)."""
    from ray import serve

    from cluster.app import build_app

    app = build_app(config)
    if ingress_env:
        ingress = app._bound_deployment  # test-only: the same deployment, one more option
        options = dict(ingress.ray_actor_options or {})
        options["runtime_env"] = {"env_vars": dict(ingress_env)}
        app = ingress.options(ray_actor_options=options).bind(*ingress.init_args, **ingress.init_kwargs)
    serve.run(app, name=config.app_name, route_prefix=config.route_prefix)


def worker_stats(app_name: str) -> dict[str, Any]:
    from ray import serve

    return serve.get_deployment_handle("worker", app_name).stats.remote().result(timeout_s=30)


def wait_for(condition: Callable[[], T], what: str, timeout_s: float = 60.0) -> T:
    """Poll `condition` until it returns something truthy (bounded; never a fixed sleep).
    The name and signature other test modules import; the loop is waiting.wait_until."""
    return wait_until(condition, timeout_s, interval_s=0.05, message=what)


def all_blocks_free(app_name: str) -> bool:
    stats = worker_stats(app_name)
    return stats["free_blocks"] == stats["total_blocks"] and not stats.get("num_running") and not stats.get("num_waiting")


def ray_log_files() -> list[Path]:
    """Every file under this Ray session's log directory (Serve's logs, replicas' stdout
    and stderr, raylet, GCS)."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    return [p for p in logs.rglob("*") if p.is_file()]


def files_containing(needles: list[str], files: list[Path] | None = None) -> dict[str, list[str]]:
    """needle -> the log files that contain it."""
    found: dict[str, list[str]] = {}
    encoded = [(n, n.encode()) for n in needles]
    for path in files if files is not None else ray_log_files():
        try:
            data = path.read_bytes()
        except OSError:
            continue
        for needle, raw in encoded:
            if raw in data:
                found.setdefault(needle, []).append(path.name)
    return found


def stream_text(url: str, body: dict[str, Any]) -> tuple[str, int]:
    """POST a streaming completion (SSE) to `url`: the text of every chunk joined, and the
    number of chunks. Asserts a 200 and no error event."""
    import json

    import httpx

    text, chunks = "", 0
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                text += event["choices"][0]["text"]
                chunks += 1
    return text, chunks
