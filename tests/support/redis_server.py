"""A real redis-server for tests: started on a free loopback port, no persistence, and
stoppable / restartable on the same port (the "Redis down and back" tests).

`tests/conftest.py` offers it as the session fixture `redis_server`; a test that stops it
must start it again (RedisServer.stopped() does that)."""
from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from tests.support.waiting import wait_until

REDIS_SERVER = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    def __init__(self, workdir: Path, port: int | None = None, password: str | None = None) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.workdir = workdir
        self.port = port if port is not None else free_port()
        self.password = password
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=2, decode_responses=True)

    def start(self, timeout_s: float = 10.0) -> None:
        assert REDIS_SERVER is not None and not self.running
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir)]
        if self.password:
            args += ["--requirepass", self.password]
        self._process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with self.client() as c:
            def answers() -> bool:
                if not self.running:
                    raise RuntimeError(f"redis-server on port {self.port} exited at start")
                return bool(c.ping())

            wait_until(answers, timeout_s, interval_s=0.02, message=f"redis-server on port {self.port}",
                       retry_on=(redis.ConnectionError,))

    def stop(self) -> None:
        """Kills it (SIGKILL: an outage, not a shutdown); its data is gone."""
        if self._process is not None:
            self._process.kill()
            self._process.wait(timeout=10)
            self._process = None

    @contextmanager
    def stopped(self) -> Iterator[None]:
        """Down inside the block; up again (same port, empty) after it, whatever happens."""
        self.stop()
        try:
            yield
        finally:
            if not self.running:
                self.start()
