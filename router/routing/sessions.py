"""Which replica serves each session, and how many active sessions each replica holds (pure;
no Ray). The headroom policy (router/routing/policies/headroom.py) keeps one per router. A request's
session id comes from its client (client_session_id: the x-session-id header or gRPC
metadata, else the OpenAI `user` field), rides on the GenerateRequest, and the request
router reads it there (router/routing/serve_router.py's request_session_id).

A session's turns re-send its history, so the replica that served its last turn caches it
(soft affinity: router/routing/scoring.py's session credit). A session also brings future work that
no report shows while it thinks between turns: a replica whose sessions are all thinking
looks idle, takes the next new sessions, and then serves all their turns at once. So a new
session goes where the fewest active sessions are (router/routing/scoring.py's MODE_SPREAD), the
way a static partition deals them, and the count must be cheap to read at every decision.

Invariant: counts[r] == number of sessions in `_last` whose replica is r; `_last` is in
order of last dispatch (oldest first), so expiry pops from the front.
"""
from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Mapping

from router.routing.types import ReplicaKey

# Where a client names its session: this HTTP header or gRPC metadata key, else the OpenAI
# `user` field (one end user's requests share a replica's cache; soft, like any session).
SESSION_HEADER = "x-session-id"
# Longer ids are kept as a digest: the routers hold one per active session.
MAX_SESSION_ID_CHARS = 128


def client_session_id(header: str | None, user: str | None) -> str | None:
    """The session a client request belongs to (None: it names none): the x-session-id
    header, else the `user` field."""
    session_id = header or user
    if not session_id:
        return None
    if len(session_id) > MAX_SESSION_ID_CHARS:
        return "sha256:" + hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()
    return session_id


class SessionTable:
    def __init__(self, idle_s: float, max_sessions: int = 1 << 16) -> None:
        if idle_s <= 0 or max_sessions <= 0:
            raise ValueError("session idle_s and max_sessions must be > 0")
        self.idle_s = idle_s
        self.max_sessions = max_sessions
        self._last: OrderedDict[str, tuple[ReplicaKey, float]] = OrderedDict()  # session -> (replica, when)
        self._counts: Counter[ReplicaKey] = Counter()

    def __len__(self) -> int:
        return len(self._last)

    def replica_of(self, session_id: str) -> ReplicaKey | None:
        """The replica that served the session's last turn (while the session is active)."""
        entry = self._last.get(session_id)
        return entry[0] if entry is not None else None

    def active_counts(self, now: float) -> Mapping[ReplicaKey, int]:
        """Sessions per replica whose last turn was dispatched within idle_s of `now`."""
        horizon = now - self.idle_s
        while self._last:
            session_id, (replica, when) = next(iter(self._last.items()))
            if when >= horizon:
                break
            self._drop(session_id)
        return self._counts

    def touch(self, session_id: str, replica: ReplicaKey, now: float) -> None:
        """A turn of the session was dispatched to `replica` at `now`."""
        entry = self._last.pop(session_id, None)
        if entry is not None:
            self._decrement(entry[0])
        self._last[session_id] = (replica, now)
        self._counts[replica] += 1
        while len(self._last) > self.max_sessions:
            self._drop(next(iter(self._last)))

    def _drop(self, session_id: str) -> None:
        replica, _ = self._last.pop(session_id)
        self._decrement(replica)

    def _decrement(self, replica: ReplicaKey) -> None:
        self._counts[replica] -= 1
        if self._counts[replica] <= 0:
            del self._counts[replica]
