"""LoRA applied per row of the flat token batch, every resident adapter in one matmul pair.

Each wrapped projection keeps its adapters in preallocated slot stacks (S = max_loras
slots, R = max_lora_rank, P = parts of a fused projection: 3 for qkv, 2 for gate_up):

    lora_a: (S*P*R, in)    rows [s*P*R + p*R, +r)  = A of part p of the adapter in slot s
    lora_b: (S*P*R, out)   the same rows hold B^T * scaling, placed in part p's output
                           columns only (zero elsewhere): one expand covers every part

A step whose rows use slots < k (slots are handed out lowest first) computes

    xa    = x @ lora_a[:k*P*R]^T                  (T, k*P*R)   one shrink for all adapters
    xa   *= mask   mask[t, c] = 1 iff slot(t) == c // (P*R)  (rows without adapter: all 0)
    out  += xa @ lora_b[:k*P*R]                   (T, out)     one expand

Zero padding (a rank below R, a part an adapter does not target, an empty slot) adds
exact zeros, so a row without adapter gets exactly the base result and a row with one
gets exactly its own adapter's delta. A step without adapter rows skips both matmuls.

Tensor parallelism shards the adapter with its layer: a column-parallel projection keeps
A whole and this rank's output rows of B; a row-parallel one keeps this rank's input
columns of A and B whole, and its delta joins the partial output before the all_reduce
(the sum over ranks of x_r A_r^T is x A^T, and the mask and B are linear after it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.parallel import ColumnParallelLinear, RowParallelLinear, all_reduce


class LoRAStepState:
    """The current step's row -> slot map, shared by every wrapped layer of a model."""

    def __init__(self, max_loras: int, max_rank: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.num_active = 0  # slots [0, num_active) may be used this step; 0: no LoRA rows
        self._token_slots: torch.Tensor | None = None
        self._masks: dict[int, torch.Tensor] = {}

    def prepare(self, token_slots: torch.Tensor | None, num_active: int, dtype: torch.dtype) -> None:
        """`token_slots`: (T,) long on the model's device, -1 for rows of the base model,
        every slot below `num_active` (known on the host: no device sync); None: no row
        uses an adapter."""
        self._masks = {}
        self.num_active = num_active if token_slots is not None else 0
        self._token_slots, self._dtype = token_slots, dtype

    def mask(self, width: int) -> torch.Tensor:
        """(T, num_active*width): 1 where the column's slot is the row's."""
        m = self._masks.get(width)
        if m is None:
            assert self._token_slots is not None
            col_slot = torch.arange(self.num_active * width, device=self._token_slots.device) // width
            m = (self._token_slots[:, None] == col_slot[None, :]).to(self._dtype)
            self._masks[width] = m
        return m


class _LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, state: LoRAStepState, num_parts: int, in_local: int, out_local: int) -> None:
        super().__init__()
        self.base, self.state, self.num_parts = base, state, num_parts
        rows = state.max_loras * num_parts * state.max_rank
        w = base.weight
        self.register_buffer("lora_a", torch.zeros(rows, in_local, dtype=w.dtype, device=w.device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(rows, out_local, dtype=w.dtype, device=w.device), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def delta(self, x: torch.Tensor) -> torch.Tensor | None:
        k = self.state.num_active
        if k == 0:
            return None
        width = self.num_parts * self.state.max_rank
        xa = F.linear(x, self.lora_a[: k * width]) * self.state.mask(width)
        return xa @ self.lora_b[: k * width]

    def _rows(self, slot: int, part: int, rank: int) -> slice:
        lo = (slot * self.num_parts + part) * self.state.max_rank
        return slice(lo, lo + rank)

    def clear_slot(self, slot: int) -> None:
        width = self.num_parts * self.state.max_rank
        self.lora_a[slot * width : (slot + 1) * width].zero_()
        self.lora_b[slot * width : (slot + 1) * width].zero_()


class LoRAColumnLinear(_LoRALinear):
    """A column-parallel projection (qkv, gate_up) with per-row adapters."""

    def __init__(self, base: ColumnParallelLinear, state: LoRAStepState) -> None:
        super().__init__(base, state, len(base.part_ranges), base.weight.shape[1], base.weight.shape[0])
        self.part_size = getattr(base, "part_size", None)  # MLP splits gate_up by it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        d = self.delta(x)
        return out if d is None else out + d

    def write(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """A (r, in) and scaled B (out_full, r) of one part; this rank keeps its B rows."""
        rows = self._rows(slot, part, a.shape[0])
        lo, hi = self.base.part_ranges[part]
        offset = self.base.part_offsets[part]
        self.lora_a[rows].copy_(a)
        self.lora_b[rows, offset : offset + hi - lo].copy_(b[lo:hi].T)


class LoRARowLinear(_LoRALinear):
    """A row-parallel projection (o, down) with per-row adapters."""

    def __init__(self, base: RowParallelLinear, state: LoRAStepState) -> None:
        super().__init__(base, state, 1, base.weight.shape[1], base.weight.shape[0])
        self.tp = base.tp

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the all_reduce."""
        out = F.linear(x, self.base.weight)
        d = self.delta(x)
        return out if d is None else out + d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.partial(x), self.tp)

    def write(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """A (r, in_full) and scaled B (out, r); this rank keeps its A columns."""
        rows = self._rows(slot, part, a.shape[0])
        lo, hi = self.base.col_range
        self.lora_a[rows].copy_(a[:, lo:hi])
        self.lora_b[rows].copy_(b.T)
