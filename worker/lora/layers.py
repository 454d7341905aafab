"""LoRA applied per row of the flat token batch, every resident adapter in one matmul pair.

Each wrapped projection keeps its adapters in preallocated slot stacks, one pair per
part of a fused projection (S = max_loras slots, R = max_lora_rank; parts: q, k, v or
gate, up, or the one part of o and down):

    lora_a[p]: (S*R, in)      rows [s*R, s*R + r) = A of part p of the adapter in slot s
    lora_b[p]: (S*R, out_p)   the same rows hold B^T * scaling (out_p: the part's width)

A step whose rows use slots < k (slots are handed out lowest first) computes, per part,

    xa    = x @ lora_a[p][:k*R]^T                 (T, k*R)   one shrink for all adapters
    xa   *= mask   mask[t, c] = 1 iff slot(t) == c // R      (rows without adapter: all 0)
    out_p += xa @ lora_b[p][:k*R]                 (T, out_p) one expand, into the part's columns

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
    def __init__(self, base: nn.Module, state: LoRAStepState, in_local: int, part_cols: list[tuple[int, int]]) -> None:
        """`part_cols`: each part's [lo, hi) columns of the local output."""
        super().__init__()
        self.base, self.state, self.part_cols = base, state, part_cols
        rows = state.max_loras * state.max_rank
        w = base.weight
        for p, (lo, hi) in enumerate(part_cols):  # buffers: they follow the module's device and dtype
            self.register_buffer(f"lora_a_{p}", torch.zeros(rows, in_local, dtype=w.dtype, device=w.device),
                                 persistent=False)
            self.register_buffer(f"lora_b_{p}", torch.zeros(rows, hi - lo, dtype=w.dtype, device=w.device),
                                 persistent=False)

    @property
    def lora_a(self) -> list[torch.Tensor]:
        return [self._buffers[f"lora_a_{p}"] for p in range(len(self.part_cols))]  # type: ignore[misc]

    @property
    def lora_b(self) -> list[torch.Tensor]:
        return [self._buffers[f"lora_b_{p}"] for p in range(len(self.part_cols))]  # type: ignore[misc]

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (T, out_local) plus every row's adapter delta, in place."""
        k = self.state.num_active
        if k == 0:
            return out
        width = k * self.state.max_rank
        mask = self.state.mask(self.state.max_rank)
        for (lo, hi), a, b in zip(self.part_cols, self.lora_a, self.lora_b):
            xa = F.linear(x, a[:width]).mul_(mask)
            out[:, lo:hi].addmm_(xa, b[:width])
        return out

    def _rows(self, slot: int, rank: int) -> slice:
        lo = slot * self.state.max_rank
        return slice(lo, lo + rank)

    def clear_slot(self, slot: int) -> None:
        rows = self._rows(slot, self.state.max_rank)
        for a, b in zip(self.lora_a, self.lora_b):
            a[rows].zero_()
            b[rows].zero_()


class LoRAColumnLinear(_LoRALinear):
    """A column-parallel projection (qkv, gate_up) with per-row adapters."""

    def __init__(self, base: ColumnParallelLinear, state: LoRAStepState) -> None:
        cols = [(off, off + hi - lo) for off, (lo, hi) in zip(base.part_offsets, base.part_ranges)]
        super().__init__(base, state, base.weight.shape[1], cols)
        self.part_size = getattr(base, "part_size", None)  # MLP splits gate_up by it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_delta(x, self.base(x))

    def write(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """A (r, in) and scaled B (out_full, r) of one part; this rank keeps its B rows."""
        rows = self._rows(slot, a.shape[0])
        lo, hi = self.base.part_ranges[part]
        self.lora_a[part][rows].copy_(a)
        self.lora_b[part][rows].copy_(b[lo:hi].T)


class LoRARowLinear(_LoRALinear):
    """A row-parallel projection (o, down) with per-row adapters."""

    def __init__(self, base: RowParallelLinear, state: LoRAStepState) -> None:
        super().__init__(base, state, base.weight.shape[1], [(0, base.weight.shape[0])])
        self.tp = base.tp

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the all_reduce."""
        return self.add_delta(x, F.linear(x, self.base.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(self.partial(x), self.tp)
        return out if self.base.bias is None else out + self.base.bias

    def write(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """A (r, in_full) and scaled B (out, r); this rank keeps its A columns."""
        rows = self._rows(slot, a.shape[0])
        lo, hi = self.base.col_range
        self.lora_a[part][rows].copy_(a[:, lo:hi])
        self.lora_b[part][rows].copy_(b.T)


class LoRAReplicatedLinear(_LoRALinear):
    """A projection every rank holds whole (MLA's q_a_proj and kv_a_proj_with_mqa, a biased
    single-device o_proj): one part, A and B kept whole, no collective."""

    def __init__(self, base: nn.Linear, state: LoRAStepState) -> None:
        super().__init__(base, state, base.weight.shape[1], [(0, base.weight.shape[0])])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_delta(x, self.base(x))

    def write(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """A (r, in) and scaled B (out, r), both whole."""
        rows = self._rows(slot, a.shape[0])
        self.lora_a[part][rows].copy_(a)
        self.lora_b[part][rows].copy_(b.T)

