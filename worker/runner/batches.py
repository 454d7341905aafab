"""The model runner's per-step records: a step's flat inputs built on the host, and a step
between launch and wait (worker/runner/model_runner.py)."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.sampling.sampled_batch import SampledBatch
from worker.scheduling.plan import SchedulerOutput
from worker.spec.verify import VerifyLaunch


@dataclass
class HostBatch:
    """One step's flat inputs, built on the host (CPU tensors), rows in execution order
    (decodes first, shortest context first; then prefill chunks)."""

    input_ids: torch.Tensor  # (T,) long
    positions: torch.Tensor  # (T,) long
    slot_mapping: torch.Tensor  # (T,) long
    # (S, max_blocks) long, rows padded with block 0; None when the tables are persistent
    block_table: torch.Tensor | None
    # the persistent tables' (S, W) int32 rows on the device (worker/runner/block_table.py)
    device_table: torch.Tensor | None
    context_lens: torch.Tensor  # (S,) long: cached + this step's tokens
    starts: list[int]  # first position computed this step, per row
    lens: list[int]  # tokens this step, per row
    query_start: list[int]  # first flat token, per row
    num_decodes: int
    sample_rows: list[int]  # plan indices of the seqs that sample this step
    last_token_idx: list[int]  # flat token whose logits each of them samples from
    # Verify rows (speculative decoding, worker/spec/): (plan index, first flat token,
    # number of drafts k); logits at its k + 1 flat tokens. Not in sample_rows.
    draft_rows: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class LaunchedBatch:
    """A step between launch and wait: its logits queued on the device (None: nothing to
    sample on this rank), the rows they sample for, and the grammar masks being built."""

    plan: SchedulerOutput
    sample_rows: list[int]
    logits: torch.Tensor | None
    masks: Future[Any] | None  # worker/structured/bitmask.py's MaskPrefetcher
    # Queued by the next launch when that one was launched ahead (it reads the ids on the
    # device); else by wait.
    sampled: SampledBatch | None = None
    # Its verify rows' acceptance, queued on the device (speculative decoding).
    verify: VerifyLaunch | None = None
