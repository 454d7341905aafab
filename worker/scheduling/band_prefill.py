"""Short steps for worse bands: the prompt tokens a step gives bands worse than the best
one in use on this replica.

A request reaches the engine while a step is on the device and waits it out, whatever its
band: band order (worker/scheduling/bands.py) decides what goes into the NEXT step. A worse band's
prompt chunk of max_num_batched_tokens makes that step several times as long as a decode
step, and a better band's request that arrives behind it waits that long before its own
prefill starts. So, while a better band is in use here, a worse band's prompt chunks share
a small token limit per step:

    a step gives the prompt chunks of bands worse than `best` at most `max_tokens` tokens
    in all (the step's rows in plan order, each taking what the earlier ones left); the
    better band's own chunks, and every decode, keep the whole token budget;
    `best` = the best band that ran or waited on this replica within the last `window_s`
    (a better band's requests come and go: between two of them the replica still serves
    that band, and the next one should not find a long step in its way).

Single-band traffic (every request of one band, whatever it is) is never limited: nothing is
better than the band it runs. The limit costs a worse band's prompt little throughput while
decodes share its steps: every step reads the weights for the decodes anyway, and a chunk of
a few hundred tokens rides mostly on those reads (worker/costs/cost_model.py), so several
small chunks take no more device time than one whole chunk, and the decodes beside them
advance once per step. Its price is the worse band's own TTFT: a long prompt takes more
steps to prefill.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from worker.sequence import Sequence

# How long a better band counts as in use after its last sequence ran or waited here: a
# few of its requests' lifetimes, so that a steady trickle of them stays protected.
WINDOW_S = 10.0


class BandPrefillLimit:
    """One replica's rule; the scheduler calls `start_step` once per plan, `allowed` for
    each prompt chunk it is about to plan and `spend` for each one it planned."""

    def __init__(self, max_tokens: int, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.window_s = window_s
        self.clock = clock
        self.best: int | None = None  # the best band in use (None: nothing seen yet)
        self._best_seen_s = 0.0  # when a sequence of `best` last ran or waited here
        self._left = max_tokens  # this step's tokens left to the worse bands
        self.num_limited = 0  # prompt chunks cut below what the token budget allowed

    def start_step(self, running: list[Sequence], waiting: deque[Sequence]) -> None:
        """A new plan: note the best band that runs or waits now (the waiting queue is in
        band order: its head is its best), and renew the worse bands' tokens."""
        self._left = self.max_tokens
        now_best = min((s.params.priority for s in running), default=None)
        if waiting and (now_best is None or waiting[0].params.priority < now_best):
            now_best = waiting[0].params.priority
        if now_best is None:
            return
        now = self.clock()
        if self.best is None or now_best <= self.best or now - self._best_seen_s > self.window_s:
            self.best, self._best_seen_s = now_best, now

    def limits(self, seq: Sequence) -> bool:
        """Is `seq` of a worse band than the best one in use?"""
        return self.best is not None and seq.params.priority > self.best

    def allowed(self, seq: Sequence, num_new: int) -> int:
        """The prompt tokens (<= num_new) `seq` may put into this step; 0 when the worse
        bands have used this step's share."""
        if not self.limits(seq) or num_new <= self._left:
            return num_new
        self.num_limited += 1
        return self._left

    def spend(self, seq: Sequence, num_new: int) -> None:
        """`seq`'s prompt chunk of `num_new` tokens went into this step's plan."""
        if self.limits(seq):
            self._left -= num_new
