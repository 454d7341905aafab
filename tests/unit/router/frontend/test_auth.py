"""router/frontend/auth.py: key parsing and hashing, constant-time matching; router/frontend/key_limits.py:
the per-key token bucket and concurrency limit counted in this process (no Ray)."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
from dataclasses import dataclass
from collections.abc import Awaitable
from typing import Any, TypeVar

import pytest

from router.frontend import auth
from router.frontend.auth import ApiKeyConfigError, ApiKeys, Principal
from router.errors import APIError
from router.frontend.key_limits import JointPermit, KeyLimits, LocalLimitStore, TokenBucket, worst_case_tokens

T = TypeVar("T")


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- keys ---------------------------------------------------------------------------------
def test_plain_and_hashed_entries_parse_to_digests() -> None:
    digests = auth.parse_key_digests(f" alpha , sha256:{sha('beta')},, SHA256:{sha('gamma').upper()} ")
    assert digests == [hashlib.sha256(k.encode()).digest() for k in ("alpha", "beta", "gamma")]


def test_malformed_hash_entry_is_rejected_without_quoting_it() -> None:
    with pytest.raises(ApiKeyConfigError) as e:
        auth.parse_key_digests("ok-key, sha256:secret-not-hex")
    assert "secret-not-hex" not in str(e.value) and "entry 2" in str(e.value)


def test_plaintext_is_not_kept() -> None:
    keys = ApiKeys.from_env("KEYS", {"KEYS": "very-secret-plaintext"})
    state = repr(vars(keys))
    assert "very-secret-plaintext" not in state
    assert keys.enabled and len(keys) == 1


def test_authenticate_accepts_configured_keys_and_rejects_others() -> None:
    keys = ApiKeys.from_env("KEYS", {"KEYS": f"k1,sha256:{sha('k2')}"})
    p1 = keys.authenticate("Bearer k1")
    p2 = keys.authenticate("bearer   k2 ")
    assert p1 != p2 and p1.key_id == sha("k1")[:12] and p2.key_id == sha("k2")[:12]
    for header in (None, "", "Bearer", "Bearer ", "Basic k1", "k1", "Bearer k3", "Bearer k1x"):
        with pytest.raises(APIError) as e:
            keys.authenticate(header)
        assert e.value.status == 401 and e.value.code == "invalid_api_key"
        assert "k1" not in e.value.message


def test_no_keys_means_auth_off() -> None:
    for env in ({}, {"KEYS": ""}, {"KEYS": " , "}):
        keys = ApiKeys.from_env("KEYS", env)
        assert not keys.enabled
        assert keys.authenticate(None) is auth.ANONYMOUS
    assert not ApiKeys.from_env(None, {"KEYS": "x"}).enabled


def test_startup_log_says_whether_auth_is_on(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="router.frontend.auth"):
        ApiKeys.from_env("KEYS", {}).log_startup("KEYS")
        ApiKeys.from_env("KEYS", {"KEYS": "topsecret"}).log_startup("KEYS")
    assert "authentication OFF" in caplog.text and "authentication on: 1 key(s)" in caplog.text
    assert "topsecret" not in caplog.text


def test_match_compares_every_digest_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    keys = ApiKeys.from_env("KEYS", {"KEYS": "a,b,c"})
    assert keys.match("a") is not None  # the first matches: the others are compared anyway
    assert len(calls) == 3 and all(len(x) == len(y) == 32 for x, y in calls)
    calls.clear()
    assert keys.match("zzz") is None
    assert len(calls) == 3


def test_grpc_authorization_metadata() -> None:
    assert auth.grpc_authorization([("application", "x"), ("authorization", "Bearer k")]) == "Bearer k"
    assert auth.grpc_authorization([("authorization", b"Bearer k")]) == "Bearer k"
    assert auth.grpc_authorization([]) is None and auth.grpc_authorization(None) is None


# -- token bucket -------------------------------------------------------------------------
def test_token_bucket_is_exact() -> None:
    clock = Clock()
    bucket = TokenBucket(600, clock)  # 10 tokens per second
    assert bucket.take(600) == 0.0 and bucket.tokens == 0.0
    assert bucket.take(1) == pytest.approx(0.1)  # nothing taken
    clock.now += 1.0
    assert bucket.tokens == pytest.approx(10.0)
    assert bucket.take(25) == pytest.approx(1.5)
    clock.now += 1.5
    assert bucket.take(25) == 0.0 and bucket.tokens == pytest.approx(0.0)
    bucket.give_back(7)
    assert bucket.tokens == pytest.approx(7.0)
    clock.now += 3600
    assert bucket.tokens == 600.0  # capped at capacity
    bucket.give_back(100)
    assert bucket.tokens == 600.0
    assert math.isinf(bucket.take(601))


def test_clock_going_backwards_adds_nothing() -> None:
    clock = Clock()
    bucket = TokenBucket(60, clock)
    bucket.take(60)
    clock.now -= 100
    assert bucket.tokens == 0.0


@dataclass
class _Params:
    max_tokens: int


@dataclass
class _Input:
    prompt_index: int
    prompt_token_ids: list[int]
    params: _Params


def test_worst_case_counts_each_prompt_once_and_max_tokens_per_choice() -> None:
    inputs = [_Input(0, [1, 2, 3], _Params(10)), _Input(0, [1, 2, 3], _Params(10)), _Input(1, [4], _Params(5))]
    assert worst_case_tokens(inputs) == 3 + 1 + 10 + 10 + 5


# -- per-key limits (router/frontend/key_limits.py, counted in this process) -------------------------
def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


def local(limits: KeyLimits) -> LocalLimitStore:
    assert isinstance(limits.store, LocalLimitStore)
    return limits.store


def test_concurrency_limit_per_key() -> None:
    limits = KeyLimits(max_concurrent_requests=2)
    first, second = run(limits.acquire("a")), run(limits.acquire("a"))
    with pytest.raises(APIError) as e:
        run(limits.acquire("a"))
    assert e.value.status == 429 and e.value.code == "concurrency_limit_exceeded" and "limit is 2" in e.value.message
    run(limits.acquire("b")).release()  # other keys are not affected
    first.release()
    first.release()  # idempotent
    assert local(limits).in_flight("a") == 1
    run(limits.acquire("a")).release()
    second.release()
    assert local(limits).in_flight("a") == 0


def test_tokens_per_minute_charge_and_refund() -> None:
    clock = Clock()
    limits = KeyLimits(tokens_per_minute=120, clock=clock)  # 2 tokens per second
    tokens_left = lambda: local(limits).tokens_left("k", 120)  # noqa: E731
    lease = run(limits.acquire("k"))
    run(lease.charge(100))
    assert tokens_left() == pytest.approx(20)
    other = run(limits.acquire("k"))
    with pytest.raises(APIError) as e:
        run(other.charge(50))
    assert e.value.status == 429 and e.value.code == "tokens_per_minute_exceeded"
    assert "retry in 15 s" in e.value.message  # (50 - 20) / 2
    assert tokens_left() == pytest.approx(20)  # a refused charge takes nothing
    lease.settle(30)  # used 30 of 100: 70 back
    lease.settle(0)  # once only
    assert tokens_left() == pytest.approx(90)
    with pytest.raises(APIError) as e:
        run(other.charge(121))
    assert "more than this API key's limit of 120 tokens per minute" in e.value.message
    run(other.charge(90))
    other.settle(500)  # used more than charged: no refund, no debt
    assert tokens_left() == pytest.approx(0)
    clock.now += 30
    assert tokens_left() == pytest.approx(60)


def test_joint_permit_releases_both() -> None:
    released: list[str] = []

    class P:
        def release(self) -> None:
            released.append("in-flight")

    limits = KeyLimits(max_concurrent_requests=1, tokens_per_minute=60, clock=Clock())
    lease = run(limits.acquire("k"))
    run(lease.charge(10))
    joint = JointPermit(P(), lease)
    joint.settle(4)
    joint.release()
    assert released == ["in-flight"] and local(limits).in_flight("k") == 0
    assert local(limits).tokens_left("k", 60) == pytest.approx(56)
    no_key = JointPermit(P(), None)
    no_key.settle(3)
    no_key.release()
