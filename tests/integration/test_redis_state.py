"""Per-key limits counted in Redis through Serve (cluster/state_store.py), and Redis down
and back while requests flow: every request still succeeds, then Redis counts again.

Redis is a real redis-server (tests/support/redis_server.py). That the ingress counts in Redis is
shown from outside: slots the test writes into the key's Redis sorted set (as another
ingress replica would hold them) make the next request a 429; the token bucket it charges
appears under the app's key prefix.
"""
from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration import tiny_app
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

APP = "redis-state-test"
MODEL = "tiny-redis"
KEY = "kvs-test-key-redis-3b9e20"
KEY_ID = hashlib.sha256(KEY.encode()).hexdigest()[:12]
SLOTS = f"kvserve:{APP}:key:{KEY_ID}:slots"
TOKENS = f"kvserve:{APP}:key:{KEY_ID}:tokens"
MAX_CONCURRENT = 2
# Digests only: the variable travels in a Ray runtime_env (see test_auth.py).
ENV = {"KVSERVE_TEST_REDIS_KEYS": f"sha256:{hashlib.sha256(KEY.encode()).hexdigest()}"}


@dataclass
class Api:
    root: str
    redis: RedisServer

    def post(self) -> httpx.Response:
        with httpx.Client(base_url=self.root, headers={"authorization": f"Bearer {KEY}"}, timeout=60) as c:
            return c.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})


@pytest.fixture(scope="module")
def api(serve_cluster: Any, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    from ray import serve

    from tests.support.tiny_served_model import make_served_model

    model_dir: Path = make_served_model(tmp_path_factory.mktemp("redis-state") / "tiny")
    config = tiny_app.tiny_config(
        APP,
        model_dir,
        MODEL,
        {
            "api_keys_env": "KVSERVE_TEST_REDIS_KEYS",
            "max_concurrent_requests_per_key": MAX_CONCURRENT,
            "tokens_per_minute_per_key": 1_000_000,
        },
    ).with_overrides({"state.redis_url": redis_server.url, "state.socket_timeout_s": 1.0})  # 1 s: a loaded CI box
    tiny_app.deploy(config, ingress_env=ENV)
    try:
        yield Api(f"{serve_cluster.http_url}/{APP}", redis_server)
    finally:
        serve.delete(APP)


def held_elsewhere(redis: RedisServer, count: int) -> list[str]:
    """`count` slots of another (live) ingress replica for the test key, in Redis."""
    members = [f"other-replica:{i}" for i in range(count)]
    expiry_ms = int(time.time() * 1000) + 600_000
    redis.client().zadd(SLOTS, {m: expiry_ms for m in members})
    return members


def assert_limits_enforced_through_redis(api: Api) -> None:
    r = api.post()
    assert r.status_code == 200, r.text
    assert api.redis.client().exists(TOKENS), "the ingress did not charge the key's budget in Redis"
    members = held_elsewhere(api.redis, MAX_CONCURRENT)
    try:
        r = api.post()
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "concurrency_limit_exceeded"
    finally:
        api.redis.client().zrem(SLOTS, *members)
    assert api.post().status_code == 200


def test_stored_responses_live_in_redis(api: Api) -> None:
    """/v1/responses keeps stored responses in Redis with state.redis_url (every ingress
    replica sees them), with the TTL; GET and previous_response_id read them back."""
    with httpx.Client(base_url=api.root, headers={"authorization": f"Bearer {KEY}"}, timeout=60) as c:
        first = c.post("/v1/responses", json={"model": MODEL, "input": "Hello", "max_output_tokens": 2})
        assert first.status_code == 200, first.text
        response_id = first.json()["id"]
        assert 0 < api.redis.client().pttl(f"kvserve:{APP}:response:{response_id}") <= 3600_000
        assert c.get(f"/v1/responses/{response_id}").json()["output"] == first.json()["output"]
        second = c.post("/v1/responses", json={"model": MODEL, "input": "Again", "max_output_tokens": 2,
                                               "previous_response_id": response_id})
        assert second.status_code == 200 and second.json()["usage"]["input_tokens"] > first.json()["usage"]["input_tokens"]


def test_limits_are_counted_in_redis(api: Api) -> None:
    assert_limits_enforced_through_redis(api)
    # The app's prefix also holds the shared routing view (`:view:...`, `:hints`), written
    # whenever its publisher has run: only the key-limit key space is counted here.
    client = api.redis.client()
    for key in client.scan_iter(f"kvserve:{APP}:*"):  # key ids only, never the key
        assert KEY not in key, key
    assert set(client.scan_iter(f"kvserve:{APP}:key:*")) <= {SLOTS, TOKENS}


def test_serving_goes_on_while_redis_is_down_and_back(api: Api) -> None:
    statuses: list[int] = []
    failures: list[str] = []
    stop = threading.Event()

    def client_loop() -> None:  # requests flow through the whole outage, back to back
        while not stop.is_set():
            r = api.post()
            statuses.append(r.status_code)
            if r.status_code != 200:
                failures.append(r.text)

    def served_since(mark: int, count: int) -> bool:
        return len(statuses) >= mark + count

    with ThreadPoolExecutor(MAX_CONCURRENT) as pool:
        loops = [pool.submit(client_loop) for _ in range(MAX_CONCURRENT)]
        try:
            tiny_app.wait_for(lambda: served_since(0, 4), "requests before the outage")
            with api.redis.stopped():
                mark = len(statuses)
                tiny_app.wait_for(lambda: served_since(mark, 6), "requests during the outage", timeout_s=30)
            # Back, empty: the ingress reconnects and charges the budget in Redis again.
            tiny_app.wait_for(lambda: api.redis.client().exists(TOKENS), "the ingress to use Redis again", timeout_s=30)
            mark = len(statuses)
            tiny_app.wait_for(lambda: served_since(mark, 4), "requests after the outage")
        finally:
            stop.set()
            for loop in loops:
                loop.result(timeout=60)
    assert statuses and not failures, failures
    assert_limits_enforced_through_redis(api)
