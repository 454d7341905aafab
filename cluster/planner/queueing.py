"""Queueing in a pool of identical servers (M/M/c): how long the p-th percentile request
waits before its service starts, and the fewest servers that keep it under a bound.

With arrivals at rate lam, a service time s (mu = 1/s) and c servers, a = lam s is the
offered load in Erlangs (c > a for a stable queue). Erlang C, the chance a request waits:

    C(c, a) = (a^c / c!) (c / (c - a)) / (sum_{k<c} a^k / k! + (a^c / c!) (c / (c - a)))

and the wait beyond t is P(W > t) = C(c, a) exp(-(c mu - lam) t), so the p-th percentile
wait is 0 when C <= 1 - p, else ln(C / (1 - p)) / (c mu - lam).

C is computed through the Erlang B recurrence B(0) = 1, B(k) = a B(k-1) / (k + a B(k-1)),
C = c B / (c - a (1 - B)), which stays finite for any c and a.
"""
from __future__ import annotations

import math


def erlang_c(servers: int, offered: float) -> float:
    """The chance an arrival waits; 1 when the pool cannot keep up (offered >= servers)."""
    if offered <= 0:
        return 0.0
    if servers <= offered:
        return 1.0
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    return servers * b / (servers - offered * (1.0 - b))


def wait_percentile_s(servers: int, rate: float, service_s: float, percentile: float) -> float:
    """The `percentile` (0..100) wait before service; inf when the pool cannot keep up."""
    if rate <= 0:
        return 0.0
    offered = rate * service_s
    if servers <= offered:
        return math.inf
    chance = erlang_c(servers, offered)
    tail = 1.0 - percentile / 100.0
    if chance <= tail:
        return 0.0
    return math.log(chance / tail) / (servers / service_s - rate)


def servers_for_wait(rate: float, service_s: float, percentile: float, max_wait_s: float, limit: int = 4096) -> int:
    """The fewest servers whose `percentile` wait is at most `max_wait_s` (0 for no load);
    `limit` when even that many are not enough."""
    if rate <= 0:
        return 0
    servers = max(1, math.floor(rate * service_s) + 1)
    while servers < limit and wait_percentile_s(servers, rate, service_s, percentile) > max_wait_s:
        servers += 1
    return servers
