"""Time spent in the model forward (+ logits): CUDA events on CUDA, wall clock on CPU.

On CUDA the host returns from the forward long before the GPU finishes it, so a wall
clock there measures kernel launches, not the forward. Events are recorded on the stream
around it and read without a sync of their own: a step that samples reads them after the
sampler's one host sync (the sampled ids), when they have completed. A step that samples
nothing (a middle prefill chunk) has no sync; its events are queried without waiting,
and if they have not completed yet, their time is carried into the next reading, so the
engine's running total stays exact and no step adds a host sync.
"""
from __future__ import annotations

import time

import torch


class ForwardTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._start_s = 0.0
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def start(self) -> None:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events = (start, end)
        else:
            self._start_s = time.perf_counter()

    def stop(self) -> None:
        """Mark the end of the forward (CUDA: recorded on the stream; nothing waits)."""
        if self.cuda and self._events is not None:
            self._events[1].record()
            self._pending.append(self._events)
            self._events = None
        elif not self.cuda:
            self._start_s = time.perf_counter() - self._start_s

    def elapsed_s(self) -> float:
        """Seconds of the forwards measured since the last reading that have completed."""
        if not self.cuda:
            return self._start_s
        done = 0.0
        still: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        for start, end in self._pending:
            if end.query():  # completed: elapsed_time does not block
                done += start.elapsed_time(end) / 1000.0
            else:
                still.append((start, end))
        self._pending = still
        return done
