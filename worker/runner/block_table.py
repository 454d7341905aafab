"""The block tables of the running requests, kept on the device between steps and updated
with the new block ids only.

A request's table grows by one block every block_size tokens, but rebuilding every row's
table each step (a padded (S, W) host array, then its copy to the device) costs host time
in proportion to the batch's total context. Here each request owns a row of a persistent
(R, W) table, mirrored on the host; a step writes only the entries appended since the
request's last step and scatters just those to the device.

    host mirror / device table (R rows, W = cdiv(max_model_len, block_size) columns):
      row slot(request) = its block ids [b0 b1 ... b_{n-1}], entries past n stale
    a step's rows, in execution order:  rows[r] = slot(seqs[order[r]])
    the step's block table = device_table[rows]   (one device gather)

Rules that keep the mirror right:
- a table is identified by its list object (rows are keyed by it, not by request id):
  the cache manager keeps one list per request for its lifetime (kv/cache_manager.py),
  appends to it, and makes a new one when the request is admitted again after
  preemption. (A TP rank's mirror may rewrite a list in place: no persistent table there.)
  A new object claims a row and writes it whole.
- a table is cut back only by the cache manager's `shrink` (lookahead blocks of rejected
  draft tokens), which marks the list (`BlockIds.rewrite_from`, the lowest length since
  the mark was cleared); a step rewrites the row from there and clears the mark. A cut
  seen directly (fewer entries than synced) is handled the same way.
- entries only change in place behind a sliding window (released blocks renamed to the
  null block); attention never reads them there, so the stale ids left in the mirror for
  those positions are never read either.
- a slot is reused only for a table absent from the current step; one that comes back
  after losing its slot gets a fresh one, written whole.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker.scheduling.plan import SchedulerOutput


@dataclass
class _Row:
    slot: int
    table: list[int]  # the cache manager's list object for this request
    synced: int  # entries of `table` already in the mirror
    last_step: int


class PersistentBlockTable:
    """Per-request rows of block ids on the host and the device; see the module docstring."""

    def __init__(self, num_rows: int, max_blocks_per_seq: int, device: torch.device, fill_block: int = 0) -> None:
        self.num_rows, self.width = num_rows, max_blocks_per_seq
        self.host = np.full((num_rows, max_blocks_per_seq), fill_block, dtype=np.int32)
        self.device_table = torch.full((num_rows, max_blocks_per_seq), fill_block, dtype=torch.int32, device=device)
        self._device = device
        self._rows: dict[int, _Row] = {}  # id(table list) -> its row
        self._free = list(range(num_rows - 1, -1, -1))
        self._step = 0

    def sync(self, plan: SchedulerOutput, order: list[int]) -> np.ndarray:
        """Bring the rows of the plan's requests up to date (host and device) and return
        their slots in `order`, as an int64 array."""
        self._step += 1
        step, rows = self._step, self._rows
        slots = np.empty(len(order), dtype=np.int64)
        dirty_slots: list[int] = []
        dirty_starts: list[int] = []
        dirty_counts: list[int] = []
        dirty_ids: list[int] = []
        for r, i in enumerate(order):
            table = plan.block_ids[i]
            row = rows.get(id(table))
            if row is None:
                row = self._claim(table, step)
            n = len(table)
            cut = getattr(table, "rewrite_from", None)  # kv/cache_manager.py BlockIds: cut back since
            if cut is not None:
                table.rewrite_from = None  # type: ignore[attr-defined]
                row.synced = min(row.synced, cut)
            if n > self.width:
                raise ValueError(f"a block table of {n} entries exceeds the {self.width} columns of max_model_len")
            if n < row.synced:  # the table shrank: what it grows back into is rewritten
                row.synced = n
            elif n > row.synced:
                dirty_slots.append(row.slot)
                dirty_starts.append(row.synced)
                dirty_counts.append(n - row.synced)
                dirty_ids.extend(table[row.synced :])
                row.synced = n
            row.last_step = step
            slots[r] = row.slot
        if dirty_ids:
            self._write(dirty_slots, dirty_starts, dirty_counts, dirty_ids)
        return slots

    def gather(self, slots: np.ndarray) -> torch.Tensor:
        """The step's (S, W) int32 block table on the device: one gather of its rows."""
        index = torch.from_numpy(slots)
        if self._device.type == "cuda":
            index = index.pin_memory()
        return self.device_table.index_select(0, index.to(self._device, non_blocking=True))

    def _claim(self, table: list[int], step: int) -> _Row:
        """A slot for a table new to the mirror. The row holds the list, so its id() is
        not reused while the row lives."""
        if not self._free:
            self._evict_absent(step)
        row = _Row(self._free.pop(), table, 0, step)
        self._rows[id(table)] = row
        return row

    def _evict_absent(self, step: int) -> None:
        """Free the slots of every request not in the current step (they may come back:
        they then claim a slot anew)."""
        for key in [key for key, row in self._rows.items() if row.last_step != step]:
            self._free.append(self._rows.pop(key).slot)
        if not self._free:
            raise RuntimeError(f"a step holds more than the {self.num_rows} rows of the block table")

    def _write(self, slots: list[int], starts: list[int], counts: list[int], ids: list[int]) -> None:
        """Append entries to the mirror and scatter them to the device.

            flat index of the k-th new id of a dirty row = slot * W + start + k
        """
        counts_a = np.asarray(counts, dtype=np.int64)
        base = np.asarray(slots, dtype=np.int64) * self.width + np.asarray(starts, dtype=np.int64)
        offsets = np.arange(len(ids), dtype=np.int64) - np.repeat(np.cumsum(counts_a) - counts_a, counts_a)
        flat = np.repeat(base, counts_a) + offsets
        values = np.asarray(ids, dtype=np.int32)
        self.host.reshape(-1)[flat] = values
        index, src = torch.from_numpy(flat), torch.from_numpy(values)
        if self._device.type == "cuda":
            index, src = index.pin_memory(), src.pin_memory()
        dev = self._device
        self.device_table.view(-1).index_copy_(0, index.to(dev, non_blocking=True), src.to(dev, non_blocking=True))
