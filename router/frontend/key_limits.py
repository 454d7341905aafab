"""Per-API-key limits of the ingress: concurrent requests and tokens per minute.

- concurrent requests: a request holds one slot per engine request (n x prompts) from
  admission until its stream closes, so that a batch of prompts counts as what it costs;
- tokens per minute: a token bucket (capacity = the per-minute limit, refilled
  continuously). A request is charged its worst case at admission (prompt tokens plus
  max_tokens for each choice) and refunded what it did not use when it ends.
Over a limit: 429 (RESOURCE_EXHAUSTED on gRPC) with a message that says which.

Where the counts live is a `LimitStore`: `LocalLimitStore` (this ingress replica: with N
replicas a key may get up to N times the limits cluster-wide) or a shared one that
cluster/ injects (cluster/state_store.py: Redis, falling back to a LocalLimitStore while
Redis is unreachable). Admission awaits the store (a network round trip for a shared
one, never blocking the event loop); giving back (release, refund) is synchronous and
fire-and-forget, because it runs in `finally` blocks and stream `close()`s.

Keys are named by `key_id` only (the first 12 hex digits of the key's SHA-256), never the key.
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from router import errors

Clock = Callable[[], float]


class TokenBucket:
    """`capacity` tokens, refilled at capacity/60 per second; `take` all or nothing."""

    def __init__(self, tokens_per_minute: int, clock: Clock = time.monotonic) -> None:
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


@dataclass(frozen=True)
class SlotGrant:
    """The answer to a slot request: `slot` (the store's handle, for release_slot) or None
    when the key is at its limit; `in_flight`: the key's requests in flight as counted."""

    slot: Any
    in_flight: int


@dataclass(frozen=True)
class TokenGrant:
    """The answer to a charge: `wait_s` 0.0 and a `receipt` (for refund) when taken;
    otherwise the seconds until the amount will be there (inf: never) and no receipt."""

    wait_s: float
    receipt: Any = None


class LimitStore(Protocol):
    """Where per-key slots and token budgets are counted (this replica, or shared)."""

    async def acquire_slot(self, key_id: str, limit: int) -> SlotGrant: ...

    def release_slot(self, slot: Any) -> None: ...

    async def take_tokens(self, key_id: str, amount: int, tokens_per_minute: int) -> TokenGrant: ...

    def refund_tokens(self, receipt: Any, amount: int) -> None: ...


class StateStoreFactory(Protocol):
    """What IngressSettings.state_store holds (cluster/state_store.py's RedisStoreSpec):
    picklable, built once in each ingress replica."""

    def build(self) -> LimitStore: ...

    def adapter_registry(self) -> Any: ...  # router/frontend/lora_modules.py's AdapterRegistry


@dataclass(frozen=True)
class _LocalReceipt:
    key_id: str
    tokens_per_minute: int


class LocalLimitStore:
    """The counts in this process. Thread-safe: leases may be dropped (and released by
    __del__) off the event loop. The sync methods are also the shared store's fallback."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._in_flight: dict[str, int] = {}
        self._buckets: dict[str, TokenBucket] = {}
        self._lock = threading.Lock()

    # -- sync core ------------------------------------------------------------------------
    def try_acquire(self, key_id: str, limit: int) -> SlotGrant:
        with self._lock:
            count = self._in_flight.get(key_id, 0)
            if count >= limit:
                return SlotGrant(None, count)
            self._in_flight[key_id] = count + 1
            return SlotGrant(key_id, count + 1)

    def release(self, key_id: str) -> None:
        with self._lock:
            count = self._in_flight.get(key_id, 0) - 1
            if count > 0:
                self._in_flight[key_id] = count
            else:
                self._in_flight.pop(key_id, None)

    def take(self, key_id: str, amount: int, tokens_per_minute: int) -> TokenGrant:
        with self._lock:
            wait_s = self._bucket(key_id, tokens_per_minute).take(amount)
        return TokenGrant(wait_s, _LocalReceipt(key_id, tokens_per_minute) if wait_s == 0.0 else None)

    def give_back(self, key_id: str, amount: int, tokens_per_minute: int) -> None:
        with self._lock:
            self._bucket(key_id, tokens_per_minute).give_back(amount)

    def _bucket(self, key_id: str, tokens_per_minute: int) -> TokenBucket:
        bucket = self._buckets.get(key_id)
        if bucket is None or bucket.capacity != tokens_per_minute:
            bucket = self._buckets[key_id] = TokenBucket(tokens_per_minute, self._clock)
        return bucket

    # -- introspection (tests, debugging) ---------------------------------------------------
    def in_flight(self, key_id: str) -> int:
        with self._lock:
            return self._in_flight.get(key_id, 0)

    def tokens_left(self, key_id: str, tokens_per_minute: int) -> float:
        with self._lock:
            return self._bucket(key_id, tokens_per_minute).tokens

    # -- LimitStore -----------------------------------------------------------------------
    async def acquire_slot(self, key_id: str, limit: int) -> SlotGrant:
        return self.try_acquire(key_id, limit)

    def release_slot(self, slot: Any) -> None:
        self.release(slot)

    async def take_tokens(self, key_id: str, amount: int, tokens_per_minute: int) -> TokenGrant:
        return self.take(key_id, amount, tokens_per_minute)

    def refund_tokens(self, receipt: Any, amount: int) -> None:
        self.give_back(receipt.key_id, amount, receipt.tokens_per_minute)


class KeyLimits:
    """The configured per-key limits (None: no limit) over a store (default: this replica)."""

    def __init__(
        self,
        max_concurrent_requests: int | None = None,
        tokens_per_minute: int | None = None,
        clock: Clock = time.monotonic,
        store: LimitStore | None = None,
    ) -> None:
        self.max_concurrent_requests = max_concurrent_requests
        self.tokens_per_minute = tokens_per_minute
        self.store: LimitStore = store if store is not None else LocalLimitStore(clock)

    @property
    def enabled(self) -> bool:
        return self.max_concurrent_requests is not None or self.tokens_per_minute is not None

    async def acquire(self, key_id: str, weight: int = 1) -> KeyLease:
        """`weight` concurrency slots for this key (its engine requests; when limited), or
        APIError 429 holding none. A request heavier than the whole limit is refused: the
        limit counts engine requests, and n x prompts of them would exceed it."""
        limit = self.max_concurrent_requests
        lease = KeyLease(self, key_id, [])
        if limit is None:
            return lease
        if weight > limit:
            raise errors.APIError(
                429,
                f"This request makes {weight} engine requests (n x prompts), more than this API key's limit of "
                f"{limit} in flight; lower n or send fewer prompts per request.",
                "rate_limit_error",
                None,
                "concurrency_limit_exceeded",
            )
        for _ in range(max(weight, 1)):
            try:
                grant = await self.store.acquire_slot(key_id, limit)
            except BaseException:  # the store refused (503) or the client left: hold none
                lease.release()
                raise
            if grant.slot is None:
                lease.release()
                raise errors.APIError(
                    429,
                    f"This API key already has {grant.in_flight} engine requests in flight, its limit is {limit}; "
                    "retry when one finishes.",
                    "rate_limit_error",
                    None,
                    "concurrency_limit_exceeded",
                )
            lease.slots.append(grant.slot)
        return lease


class KeyLease:
    """One request's share of its key's limits. `release()` frees the concurrency slots
    (idempotent; a GenerationStream calls it when it closes); `charge()` takes tokens at
    admission; `settle(used)` refunds what the request did not use (once)."""

    def __init__(self, limits: KeyLimits, key_id: str, slots: list[Any]) -> None:
        self._limits = limits
        self.key_id = key_id
        self.slots = slots  # the store's handles, one per engine request
        self._receipts: list[tuple[Any, int]] = []
        self._settled = False

    @property
    def charged(self) -> int:
        return sum(amount for _, amount in self._receipts)

    async def charge(self, tokens: int) -> None:
        limit = self._limits.tokens_per_minute
        if limit is None or tokens <= 0:
            return
        grant = await self._limits.store.take_tokens(self.key_id, tokens, limit)
        if grant.wait_s == 0.0:
            self._receipts.append((grant.receipt, tokens))
            return
        if math.isinf(grant.wait_s):
            message = (f"This request may use {tokens} tokens (prompt + max_tokens for each choice), more than "
                       f"this API key's limit of {limit} tokens per minute; lower max_tokens or the prompt.")
        else:
            message = (f"This API key's limit of {limit} tokens per minute is used up: this request may use "
                       f"{tokens} tokens; retry in {math.ceil(grant.wait_s)} s.")
        raise errors.APIError(429, message, "rate_limit_error", None, "tokens_per_minute_exceeded")

    def settle(self, used_tokens: int) -> None:
        """Refunds charged - used, to where each charge was taken (refunds in charge order)."""
        if self._settled:
            return
        self._settled = True
        used = max(used_tokens, 0)
        for receipt, amount in self._receipts:
            covered = min(used, amount)
            used -= covered
            if amount > covered:
                self._limits.store.refund_tokens(receipt, amount - covered)

    def release(self) -> None:
        slots, self.slots = self.slots, []
        for slot in slots:
            self._limits.store.release_slot(slot)

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
    counts it) plus max_tokens for each choice. `inputs`: openai_api.convert.EngineInput."""
    prompts: dict[int, int] = {}
    for inp in inputs:
        prompts[inp.prompt_index] = len(inp.prompt_token_ids)
    return sum(prompts.values()) + sum(int(inp.params.max_tokens) for inp in inputs)
