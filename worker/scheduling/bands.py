"""Who goes first in the engine: priority bands, and each key's share of the running slots
within a band. The scheduler (worker/scheduling/scheduler.py) asks these rules; they change nothing
themselves.

Bands (SamplingParams.priority, lower first, as vLLM's priority policy):
- `enqueue`: the waiting queue is ordered by band, FIFO within one; a preempted sequence
  goes back to the front of its band.
- `victim`: the running sequence to preempt first is the worst band's most recently
  admitted (of all, when every band is the same).
- `split_running`: within a step's token budget, a worse band's prompt chunks go after the
  better bands' decodes, chunks and waiting prompts.

Key shares (SamplingParams.tenant, the API key's id, and tenant_weight): within a band, a
key may hold at most its weighted share of the replica's running slots while another key
of that band waits,

    share(k) = max_num_seqs * weight(k) / sum of the weights of the band's keys that run or wait

- `KeyShares.pick`: the next waiting sequence to admit is the first of the head band whose
  key is under its share (one more running slot keeps it within share(k)); when every
  waiting key of the band is at its share, the head (FIFO: no slot stays idle).
- `KeyShares.victim_for`: a waiting sequence of a key under its share that finds no slot
  may preempt the most recently admitted running sequence of the band's key furthest over
  its share. Only strictly over: the preempted key cannot take the slot back (it is still
  not under its share), so no two keys trade a slot back and forth.
Sequences without a tenant ("") count as one key. Why in the engine, not at admission: only
the engine knows, step by step, which key holds which of its slots; the ingress sees each
replica's totals, and its hold queue already shares its places by the same weights.
"""
from __future__ import annotations

from collections import Counter, deque

from worker.sequence import Sequence


def enqueue(waiting: deque[Sequence], seq: Sequence, front_of_band: bool) -> None:
    """Into `waiting`, ordered by band, FIFO within a band; `front_of_band`: before the
    others of its band (a preempted sequence). All at one band: append / appendleft."""
    band = seq.params.priority
    if front_of_band:
        i = 0
        while i < len(waiting) and waiting[i].params.priority < band:
            i += 1
    else:
        i = len(waiting)
        while i > 0 and waiting[i - 1].params.priority > band:
            i -= 1
    waiting.insert(i, seq)


def victim(running: list[Sequence]) -> Sequence:
    """The running sequence to preempt first: the worst band's most recently admitted."""
    chosen = running[-1]
    for seq in reversed(running):
        if seq.params.priority > chosen.params.priority:
            chosen = seq
    return chosen


def victim_for_waiting(head: Sequence, running: list[Sequence], shares: KeyShares | None) -> Sequence | None:
    """The running sequence a waiting `head` that finds no slot or no blocks may take the
    place of: the worst band's most recently admitted, if its band is worse than `head`'s;
    else, given key shares, the one KeyShares.victim_for names; else None."""
    chosen = victim(running)
    if chosen.params.priority > head.params.priority:
        return chosen
    return shares.victim_for(head, running) if shares is not None else None


def split_running(running: list[Sequence], waiting: deque[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
    """The running sequences split: the prompt chunks of bands worse than the best band
    that runs or waits (deferred, by band, admission order within one: each band's go
    after the better bands' decodes, chunks and waiting prompts, so a better band's
    prefill never waits a step for the budget behind a worse band's), and the rest, in
    admission order."""
    priorities = [s.params.priority for s in running]
    best = min(priorities, default=0)
    if waiting:
        best = min(best, waiting[0].params.priority) if running else waiting[0].params.priority
    if not running or max(priorities) <= best:  # one band (the usual case): nothing deferred
        return list(running), []
    first: list[Sequence] = []
    deferred: list[Sequence] = []
    for seq in running:
        chunk = len(seq.token_ids) - seq.num_computed_tokens > 1
        (deferred if chunk and seq.params.priority > best else first).append(seq)
    deferred.sort(key=lambda s: s.params.priority)  # stable: admission order within a band
    return first, deferred


def _key(seq: Sequence) -> tuple[int, str]:
    return seq.params.priority, seq.params.tenant


class KeyShares:
    """One step's view of who holds the running slots, per (band, key). Built only while
    sequences wait; `admitted` / `preempted` keep it true as the step's plan changes."""

    def __init__(self, running: list[Sequence], waiting_keys: Counter[tuple[int, str]],
                 weights: dict[str, int], max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.running: Counter[tuple[int, str]] = Counter(_key(s) for s in running)
        self.waiting = waiting_keys  # the scheduler's own counts (it keeps them current)
        self.weights = weights  # tenant -> weight, as its sequences said

    def share(self, band: int, tenant: str) -> float:
        """max_num_seqs * weight / the band's running or waiting keys' weights."""
        keys = {t for b, t in self.running if b == band} | {t for (b, t), n in self.waiting.items() if b == band and n}
        total = sum(self.weights.get(t, 1) for t in keys | {tenant})
        return self.max_num_seqs * self.weights.get(tenant, 1) / total

    def under(self, seq: Sequence) -> bool:
        """Would one more running slot keep `seq`'s key within its share?"""
        band, tenant = _key(seq)
        return self.running[band, tenant] + 1 <= self.share(band, tenant)

    def pick(self, waiting: deque[Sequence]) -> int:
        """Index of the next sequence to admit: the first of the head band whose key is
        under its share, else the head."""
        band = waiting[0].params.priority
        if not self._contested(band):
            return 0
        seen: set[str] = set()
        for i, seq in enumerate(waiting):
            if seq.params.priority != band:
                break
            if seq.params.tenant in seen:
                continue
            if self.under(seq):
                return i
            seen.add(seq.params.tenant)
        return 0

    def victim_for(self, seq: Sequence, running: list[Sequence]) -> Sequence | None:
        """The running sequence `seq` may take the slot of: the most recently admitted of
        its band's key furthest over its share (strictly), when `seq`'s key is under its
        own; else None."""
        band = seq.params.priority
        if not self._contested(band) or not self.under(seq):
            return None
        over = {t: self.running[band, t] - self.share(band, t) for b, t in self.running if b == band}
        worst = max(over, key=over.__getitem__, default=None)
        if worst is None or over[worst] <= 0 or worst == seq.params.tenant:
            return None
        return next(s for s in reversed(running) if _key(s) == (band, worst))

    def admitted(self, seq: Sequence) -> None:
        self.running[_key(seq)] += 1

    def preempted(self, seq: Sequence) -> None:
        self.running[_key(seq)] -= 1

    def _contested(self, band: int) -> bool:
        """Do two keys or more of `band` run or wait? (One alone has no share to keep.)"""
        keys = {t for (b, t), n in self.running.items() if b == band and n}
        keys |= {t for (b, t), n in self.waiting.items() if b == band and n}
        return len(keys) > 1
