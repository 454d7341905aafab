"""A replica's KV geometry as the router and the simulator see it: how many pool blocks a
sequence of n tokens holds, from the replica's own KV groups (kv/kv_groups.py).

    blocks(n) = num_full_groups * ceil(n / block_size)
              + sum over sliding groups of min(ceil(n / block_size), ceil((w - 1) / block_size) + 2)

(the sliding term is KVGroupSpec.max_live_blocks for a decode). A plain full-attention
model has one full group and no sliding ones: blocks(n) = ceil(n / block_size). A latent
(MLA) model is one full group whose blocks hold fewer bytes: `bytes_per_block` says how
many, so replicas of different models compare in tokens and bytes, never in blocks.
Plain data, torch-free; it travels in the routing report as three fields.
"""
from __future__ import annotations

from dataclasses import dataclass

from kv.kv_groups import KVLayout, cdiv


@dataclass(frozen=True)
class KVGeometry:
    block_size: int
    num_full_groups: int = 1
    sliding_windows: tuple[int, ...] = ()  # one per sliding-window group
    bytes_per_block: int = 0  # one pool block over every layer slot (0: not said)

    @classmethod
    def from_layout(cls, layout: KVLayout | None, block_size: int, bytes_per_block: int = 0) -> KVGeometry:
        if layout is None:
            return cls(block_size, bytes_per_block=bytes_per_block)
        full = sum(1 for g in layout.groups if g.sliding_window is None)
        windows = tuple(g.sliding_window for g in layout.groups if g.sliding_window is not None)
        return cls(block_size, full, windows, bytes_per_block)  # type: ignore[arg-type]

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Pool blocks one sequence of `num_tokens` tokens holds (at a decode step)."""
        n = cdiv(max(num_tokens, 0), self.block_size)
        held = self.num_full_groups * n
        for window in self.sliding_windows:
            held += min(n, cdiv(window - 1, self.block_size) + 2)
        return held

    def max_sequence_tokens(self, num_blocks: int, limit: int) -> int:
        """The longest sequence (at most `limit` tokens) whose blocks_for_tokens fits in
        `num_blocks` (a binary search: blocks_for_tokens only grows with n)."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_for_tokens(mid) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def token_capacity(self, num_blocks: int) -> int:
        """Tokens `num_blocks` pool blocks hold for long sequences: the full groups grow with
        every token; a model with none grows only into its windows (per sequence), so its
        blocks count one token slot each."""
        return num_blocks * self.block_size // max(self.num_full_groups, 1)

    @property
    def bytes_per_token(self) -> float:
        """KV bytes one more token of a long sequence takes: a block per block_size tokens
        in every full group (0.0: bytes not said)."""
        return max(self.num_full_groups, 1) * self.bytes_per_block / self.block_size
