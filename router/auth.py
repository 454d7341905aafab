"""API keys and per-key limits of the ingress (HTTP `Authorization: Bearer KEY`, gRPC
metadata `authorization: Bearer KEY`).

Keys come from one environment variable (config `ingress.api_keys_env`, default
KVSERVE_API_KEYS; the Helm chart fills it from a Secret): comma-separated entries, each a
plaintext key or `sha256:<64 hex>` (the key's SHA-256, so that the plaintext need not be
stored anywhere). They are hashed when the ingress starts; only the digests are kept.
A presented key is hashed and compared with every stored digest by
`hmac.compare_digest` (no early exit: the time taken does not depend on which digest, if
any, matches, nor on how much of it matches). No keys configured: authentication is
off (the local default), and the ingress logs that once at start-up.

Per-key limits, per ingress replica (with N ingress replicas a key may get up to N
times these cluster-wide):
- concurrent requests: a request holds one slot from admission until its stream closes;
- tokens per minute: a token bucket (capacity = the per-minute limit, refilled
  continuously). A request is charged its worst case at admission (prompt tokens plus
  max_tokens for each choice) and refunded what it did not use when it ends.
Over a limit: 429 (RESOURCE_EXHAUSTED on gRPC) with a message that says which.

Keys are identified in metrics and limits by `key_id`: the first 12 hex digits of the
digest (never the key).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass

from router import errors

logger = logging.getLogger(__name__)

DEFAULT_API_KEYS_ENV = "KVSERVE_API_KEYS"
_SHA256_PREFIX = "sha256:"
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")


class ApiKeyConfigError(ValueError):
    """An entry of the API-key variable that is neither a key nor `sha256:<64 hex>`."""


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def key_id_of(digest: bytes) -> str:
    return digest.hex()[:12]


def parse_key_digests(spec: str) -> list[bytes]:
    """`"key1, sha256:ab12..., key3"` -> the SHA-256 digests. Empty entries are skipped.
    Errors never quote the entry (it may be a secret)."""
    digests: list[bytes] = []
    for position, raw in enumerate(spec.split(","), start=1):
        entry = raw.strip()
        if not entry:
            continue
        if entry.lower().startswith(_SHA256_PREFIX):
            hex_digest = entry[len(_SHA256_PREFIX):].strip()
            if not _HEX64.match(hex_digest):
                raise ApiKeyConfigError(f"API key entry {position}: 'sha256:' must be followed by 64 hex digits")
            digests.append(bytes.fromhex(hex_digest))
        else:
            digests.append(hash_key(entry))
    return digests


@dataclass(frozen=True)
class Principal:
    """Who made a request: a key's id, or the anonymous caller when auth is off."""

    key_id: str


ANONYMOUS = Principal("anonymous")


class ApiKeys:
    """The configured keys, as SHA-256 digests only."""

    def __init__(self, digests: list[bytes]) -> None:
        self._digests = tuple(dict.fromkeys(digests))  # de-duplicated, order kept

    @classmethod
    def from_env(cls, name: str | None, environ: dict[str, str] | None = None) -> ApiKeys:
        env = os.environ if environ is None else environ
        if not name:
            return cls([])
        return cls(parse_key_digests(env.get(name, "")))

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def match(self, key: str) -> Principal | None:
        """The key's principal when it is one of the configured keys. Every digest is
        compared, in constant time each, whatever matches."""
        candidate = hash_key(key)
        found: bytes | None = None
        for digest in self._digests:
            if hmac.compare_digest(candidate, digest):
                found = digest
        return None if found is None else Principal(key_id_of(found))

    def authenticate(self, authorization: str | None) -> Principal:
        """The caller of a request with this `Authorization` value (HTTP header or gRPC
        metadata). Auth off: ANONYMOUS. Raises APIError 401 otherwise."""
        if not self.enabled:
            return ANONYMOUS
        key = bearer_token(authorization)
        if key is None:
            raise unauthenticated("Missing API key: send it as 'Authorization: Bearer <key>'.")
        principal = self.match(key)
        if principal is None:
            raise unauthenticated("Incorrect API key provided.")
        return principal

    def log_startup(self, env_name: str | None) -> None:
        if self.enabled:
            logger.info("API key authentication on: %d key(s) from $%s", len(self), env_name)
        else:
            logger.warning(
                "API key authentication OFF: no keys in $%s; every client may use this server",
                env_name or "(no api_keys_env)",
            )


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def grpc_authorization(metadata: list[tuple[str, str | bytes]] | None) -> str | None:
    """The `authorization` entry of gRPC invocation metadata (keys arrive lower-case)."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return None


def unauthenticated(message: str) -> errors.APIError:
    return errors.APIError(401, message, "invalid_request_error", None, "invalid_api_key")


# -- per-key limits ------------------------------------------------------------------------
class TokenBucket:
    """`capacity` tokens, refilled at capacity/60 per second; `take` all or nothing."""

    def __init__(self, tokens_per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = float(tokens_per_minute)
        self.rate = tokens_per_minute / 60.0
        self._clock = clock
        self._tokens = self.capacity
        self._stamp = clock()

    @property
    def tokens(self) -> float:
        self._refill()
        return self._tokens

    def _refill(self) -> None:
        now = self._clock()
        if now > self._stamp:
            self._tokens = min(self.capacity, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def take(self, amount: int) -> float:
        """Takes `amount` and returns 0.0, or takes nothing and returns the seconds until
        `amount` will be there (inf when it never fits)."""
        self._refill()
        if amount <= self._tokens:
            self._tokens -= amount
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - self._tokens) / self.rate

    def give_back(self, amount: float) -> None:
        self._refill()
        self._tokens = min(self.capacity, self._tokens + max(amount, 0.0))


class _KeyState:
    __slots__ = ("in_flight", "bucket")

    def __init__(self, bucket: TokenBucket | None) -> None:
        self.in_flight = 0
        self.bucket = bucket


class KeyLimits:
    """Per-key concurrency and tokens per minute on this ingress replica. None: no limit.
    Thread-safe (tokenization of large bodies runs in a thread; the rest on the loop)."""

    def __init__(
        self,
        max_concurrent_requests: int | None = None,
        tokens_per_minute: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_concurrent_requests = max_concurrent_requests
        self.tokens_per_minute = tokens_per_minute
        self._clock = clock
        self._keys: dict[str, _KeyState] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_concurrent_requests is not None or self.tokens_per_minute is not None

    def _state(self, key_id: str) -> _KeyState:
        state = self._keys.get(key_id)
        if state is None:
            bucket = TokenBucket(self.tokens_per_minute, self._clock) if self.tokens_per_minute is not None else None
            state = self._keys[key_id] = _KeyState(bucket)
        return state

    def acquire(self, principal: Principal) -> KeyLease:
        """A concurrency slot for this key, or APIError 429."""
        with self._lock:
            state = self._state(principal.key_id)
            limit = self.max_concurrent_requests
            if limit is not None and state.in_flight >= limit:
                raise errors.APIError(
                    429,
                    f"This API key already has {state.in_flight} requests in flight, its limit is {limit}; "
                    "retry when one finishes.",
                    "rate_limit_error",
                    None,
                    "concurrency_limit_exceeded",
                )
            state.in_flight += 1
        return KeyLease(self, state)

    def in_flight(self, key_id: str) -> int:
        with self._lock:
            state = self._keys.get(key_id)
            return 0 if state is None else state.in_flight

    def tokens_left(self, key_id: str) -> float | None:
        with self._lock:
            bucket = self._state(key_id).bucket
            return None if bucket is None else bucket.tokens


class KeyLease:
    """One request's share of its key's limits. `release()` frees the concurrency slot
    (idempotent; a GenerationStream calls it when it closes); `charge()` takes tokens at
    admission; `settle(used)` refunds what the request did not use (once)."""

    def __init__(self, limits: KeyLimits, state: _KeyState) -> None:
        self._limits = limits
        self._state = state
        self._held = True
        self.charged = 0
        self._settled = False

    def charge(self, tokens: int) -> None:
        bucket = self._state.bucket
        if bucket is None or tokens <= 0:
            return
        with self._limits._lock:
            wait_s = bucket.take(tokens)
        if wait_s == 0.0:
            self.charged += tokens
            return
        limit = self._limits.tokens_per_minute
        if math.isinf(wait_s):
            message = (f"This request may use {tokens} tokens (prompt + max_tokens for each choice), more than "
                       f"this API key's limit of {limit} tokens per minute; lower max_tokens or the prompt.")
        else:
            message = (f"This API key's limit of {limit} tokens per minute is used up: this request may use "
                       f"{tokens} tokens; retry in {math.ceil(wait_s)} s.")
        raise errors.APIError(429, message, "rate_limit_error", None, "tokens_per_minute_exceeded")

    def settle(self, used_tokens: int) -> None:
        if self._settled:
            return
        self._settled = True
        unused = self.charged - max(used_tokens, 0)
        bucket = self._state.bucket
        if bucket is not None and unused > 0:
            with self._limits._lock:
                bucket.give_back(unused)

    def release(self) -> None:
        if self._held:
            self._held = False
            with self._limits._lock:
                self._state.in_flight -= 1

    def __del__(self) -> None:  # a dropped lease must not hold its slot forever
        try:
            self.release()
        except Exception:
            pass


class JointPermit:
    """The in-flight permit and the key lease as one `release()` (what GenerationStream
    takes); `settle` passes usage to the lease."""

    def __init__(self, permit: object, lease: KeyLease | None) -> None:
        self._permit = permit
        self.lease = lease

    def release(self) -> None:
        try:
            self._permit.release()  # type: ignore[attr-defined]
        finally:
            if self.lease is not None:
                self.lease.release()

    def settle(self, used_tokens: int) -> None:
        if self.lease is not None:
            self.lease.settle(used_tokens)


def worst_case_tokens(inputs: list[Any]) -> int:
    """What a request may use at most: each prompt once (its choices share it, as usage
    counts it) plus max_tokens for each choice. `inputs`: openai_convert.EngineInput."""
    prompts: dict[int, int] = {}
    for inp in inputs:
        prompts[inp.prompt_index] = len(inp.prompt_token_ids)
    return sum(prompts.values()) + sum(int(inp.params.max_tokens) for inp in inputs)
