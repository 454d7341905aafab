"""`kvserve serve` as a process of its own (tests that need a whole local cluster, not the
session's): started with a config, waited for until /health answers, stopped with SIGTERM
(killed if it does not exit)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.redis_server import free_port
from tests.support.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class ServeProcess:
    proc: subprocess.Popen[bytes]
    log_path: Path
    ray_tmp: Path  # its Ray temp dir ($RAY_TMPDIR)

    def log(self) -> str:
        return self.log_path.read_text()


def short_ray_tmp(prefix: str) -> Path:
    """A Ray temp dir of the test's own, short: Ray puts unix sockets under it (their paths
    are limited to ~107 bytes)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


@contextmanager
def kvserve_serve(tmp_path: Path, config_yaml: str, port: int, grpc_port: int, ray_tmp: Path,
                  drop_env: tuple[str, ...] = ()) -> Iterator[ServeProcess]:
    """`kvserve serve --config` (2 logical CPUs) on `port`/`grpc_port`, up and healthy.
    The environment is this process's without RAY_ADDRESS (the test's cluster is its own)
    and RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER (serve sets it itself), nor `drop_env`."""
    config = tmp_path / "kvserve.yaml"
    config.write_text(config_yaml)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": str(ray_tmp)}
    for name in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", *drop_env):
        env.pop(name, None)
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", "serve", "--config", str(config), "--port", str(port),
             "--grpc-port", str(grpc_port), "--num-cpus", "2"],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            def healthy() -> bool:
                assert proc.poll() is None, log_path.read_text()[-3000:]
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200

            wait_until(healthy, START_TIMEOUT_S, interval_s=1.0, message="kvserve serve to come up",
                       retry_on=(httpx.TransportError,))
            yield ServeProcess(proc, log_path, ray_tmp)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


def served_completion(tmp_path: Path, model_dir: Path, prompt: str, max_tokens: int, ray_prefix: str) -> httpx.Response:
    """`kvserve serve` on `model_dir` (CPU, float32, one worker replica) and one greedy
    OpenAI completion of `prompt` under the model's served name: the response."""
    port, grpc_port = free_port(), free_port()
    config = (
        f"model: {model_dir}\n"
        "engine: {device: cpu, dtype: float32, num_threads: 1, num_blocks: 64}\n"
        "workers: {num_replicas: 1, num_cpus: 1, drain_timeout_s: 5}\n"
        "ingress: {num_cpus: 0.5}\n"
    )
    with kvserve_serve(tmp_path, config, port, grpc_port, short_ray_tmp(ray_prefix)):
        name = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"][0]["id"]
        return httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
            "model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        })
