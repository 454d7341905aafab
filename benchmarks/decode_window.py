"""A decode window whose every timed step holds exactly the batch it is named for.

Requests are planned decodes first, then prompt chunks, so the first prompts of a batch
decode while the last ones prefill: a window that starts after the last prompt's first
token and gives every request a few tokens past it loses rows as the early ones finish.
Here every prompt is prefilled first, then `warm` untimed decode steps run, then the
`steps` timed ones; `max_tokens` covers the prefill steps (an upper bound on them), the
warm and timed steps and the step a launch-ahead loop queues past the window, so that no
row can finish inside it. Each timed step's rows (sequences that got a token) are
counted and kept, so the caller can show the window held the batch (`rows_min`).

Two loops, over the same engine API the worker serves with:
- serial: `Engine.step()` (plan, run, wait, apply, outputs) one step at a time;
- ahead: the overlapped loop of worker/engine/async_engine.py (`launch_step`, the previous
  step's `step_outputs` while the device works, `complete_step`), which launches the next
  decode step before the current one's tokens are back where the runner supports it
  (worker/scheduling/async_scheduler.py). A CPU runner does not overlap, and its engine
  steps serially; `ahead_engine` gives the same runner to an engine that runs the
  launch-ahead machinery anyway (as tests/unit/worker/scheduling/test_launch_ahead.py
  does): the forward is computed at launch, so that loop hides nothing there, it only
  shows the rows it holds.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

LOOPS = ("serial", "ahead")


@dataclass(frozen=True)
class DecodeWindow:
    """One timed window: its rows per step, its wall time and the context it decoded at."""

    batch: int
    loop: str
    rows: tuple[int, ...]
    elapsed_s: float
    mean_context: float  # tokens of context per row when the window began
    launches_ahead: bool

    @property
    def rows_min(self) -> int:
        return min(self.rows)

    @property
    def tokens_per_s(self) -> float:
        return sum(self.rows) / self.elapsed_s

    @property
    def step_ms(self) -> float:
        return 1e3 * self.elapsed_s / len(self.rows)


def prefill_steps_bound(batch: int, context_len: int, max_batched_tokens: int) -> int:
    """At most this many steps until every prompt is in: running decodes take one token of
    each step's budget, so a step prefills at least `max_batched_tokens - batch` tokens."""
    per_step = max(1, max_batched_tokens - batch)
    return -(-batch * context_len // per_step) + 1


def _sync(engine: Any) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()


def _rows(outputs: list[Any]) -> int:
    for out in outputs:
        if out.error:
            raise RuntimeError(f"request {out.request_id} failed: {out.error}")
    return sum(1 for out in outputs if out.new_token_ids)


def _prefill(engine: Any, batch: int, context_len: int, vocab: int, steps: int, warm: int, tag: str,
             seed: int) -> list[str]:
    from worker.api import SamplingParams

    bound = prefill_steps_bound(batch, context_len, engine.scheduler.config.max_num_batched_tokens)
    params = SamplingParams(max_tokens=bound + warm + steps + 4, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(seed)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, torch.randint(3, vocab, (context_len,), generator=gen).tolist(), params)
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.seqs.values()):
        engine.step()
    return ids


def _serial(engine: Any, steps: int, warm: int, around: AbstractContextManager) -> tuple[list[int], float]:
    for _ in range(warm):
        engine.step()
    _sync(engine)
    rows: list[int] = []
    with around:
        start = time.perf_counter()
        for _ in range(steps):
            rows.append(_rows(engine.step()))
        _sync(engine)
        return rows, time.perf_counter() - start


def _ahead(engine: Any, steps: int, warm: int, around: AbstractContextManager) -> tuple[list[int], float]:
    """The overlapped loop; the window runs from step `warm - 1`'s completion to the
    completion of `steps` more, and counts the rows of those `steps` steps."""
    with around:
        return _ahead_steps(engine, steps, warm)


def _ahead_steps(engine: Any, steps: int, warm: int) -> tuple[list[int], float]:
    rows: list[int] = []
    applied = None
    start = 0.0
    for i in range(warm + steps):
        launched = engine.launch_step()
        if applied is not None:
            counted = _rows(engine.step_outputs(applied))
            if i > warm:
                rows.append(counted)
        applied = engine.complete_step(launched)
        if i == warm - 1:
            _sync(engine)
            start = time.perf_counter()
    _sync(engine)
    elapsed = time.perf_counter() - start
    rows.append(_rows(engine.step_outputs(applied)))
    return rows, elapsed


def ahead_engine(engine: Any) -> Any:
    """An engine that runs the launch-ahead loop on `engine`'s runner: `engine` itself
    where the runner overlaps the device; else a second engine whose runner (the same
    object, its class told it overlaps) computes each step at launch. Both share the
    runner's KV memory: use one at a time, and `engine.reset_prefix_cache()` before going
    back to the first (its cached blocks were overwritten)."""
    from worker.engine.core import Engine

    if engine.overlaps_device:
        return engine
    runner = engine.runner
    runner.__class__ = type(f"HostOverlapping{type(runner).__name__}", (type(runner),),
                            {"overlaps_device": property(lambda self: True)})
    return Engine(engine.scheduler_config, engine.cache_config, runner, engine.vocab_size, engine.eos_token_ids)


def decode_window(engine: Any, batch: int, context_len: int, vocab: int, steps: int, loop: str = "serial",
                  warm: int = 2, tag: str = "decode", seed: int = 0,
                  around: Callable[[], AbstractContextManager] = contextlib.nullcontext) -> DecodeWindow:
    """Prefill `batch` prompts of `context_len` tokens, then time `steps` decode steps of
    the loop (inside `around()`, e.g. a profiler); every request is aborted (and a step
    launched ahead completed) after."""
    if loop not in LOOPS:
        raise ValueError(f"unknown loop {loop!r}: one of {LOOPS}")
    if warm < 1:
        raise ValueError("warm must be at least 1 (the ahead loop times from a completed step)")
    ids = _prefill(engine, batch, context_len, vocab, steps, warm, tag, seed)
    mean_context = sum(s.num_computed_tokens for s in engine.seqs.values()) / batch
    rows, elapsed = (_serial if loop == "serial" else _ahead)(engine, steps, warm, around())
    for rid in ids:
        engine.abort_request(rid)
    engine.complete_step(engine.launch_step())  # a step launched ahead, if any, off the device
    return DecodeWindow(batch, loop, tuple(rows), elapsed, mean_context, engine.launches_ahead)
