"""KV cache groups: which layers share a block table, and what each kind of layer keeps.

A model's layers fall into cache kinds (vLLM's hybrid KV cache manager has the same shape):

    full_attention   every token's K/V for the sequence's whole life
    sliding_window   only the K/V of the last `window` positions: a query at p sees keys
                     p - window < k <= p, so blocks wholly before the oldest query's window
                     go back to the pool as the sequence advances
    (latent)         MLA: one latent vector (+ its RoPE part) per token, kept like
                     full_attention; only bytes per token differ (a spec field, not a kind)
    (recurrent)      Gated DeltaNet / Mamba: a fixed-size state per sequence, not per
                     token; a kind whose blocks_needed is constant (see docs/architecture.md)

Layers are split into GROUPS of equal size (`layers_per_group`), each group of one kind,
one block table per group per request. All groups draw from ONE block pool, and the KV
tensor has `layers_per_group` layer slots: a block id names one page in every slot, and
the group that holds the block owns that page in all of them, so a block costs the same
bytes whichever group holds it (no per-kind split of memory is ever decided up front):

    layers (Gemma 3, 5 sliding : 1 full, 12 layers)   S S S S S F S S S S S F
    counts: sliding 10, full 2 -> layers_per_group = gcd(10, 2) = 2
    groups: g0 full (5, 11)  g1 sliding (0, 1)  g2 (2, 3)  g3 (4, 6)  g4 (7, 8)  g5 (9, 10)
    layer -> (group, slot):  layer 11 -> (g0, slot 1), layer 4 -> (g3, slot 0)
    kv tensor: (layers_per_group, 2, num_blocks, block_size, Hkv, D)

Group 0 is a full-attention group when the model has one: its table spans the whole
sequence and its block hashes are the ones the router and the KV tiers see. A model of
one kind has one group holding every layer (the layout of a plain full-attention model).
Pure arithmetic, no torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import gcd

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
KINDS = (FULL_ATTENTION, SLIDING_WINDOW)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVGroupSpec:
    """One group of layers of one cache kind, and the rule for the blocks it keeps."""

    kind: str
    layer_ids: tuple[int, ...]
    sliding_window: int | None = None  # set iff kind == SLIDING_WINDOW

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown KV cache kind {self.kind!r} ({', '.join(KINDS)})")
        if (self.kind == SLIDING_WINDOW) != (self.sliding_window is not None):
            raise ValueError("a sliding_window group needs its window, and only it has one")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding window must be >= 1, got {self.sliding_window}")

    @property
    def frees_blocks(self) -> bool:
        return self.kind == SLIDING_WINDOW

    def first_needed_block(self, num_computed_tokens: int, block_size: int) -> int:
        """Index of the first block a query at position >= num_computed_tokens can still
        read: 0 for full attention; for a window w, the block of position c - w + 1."""
        if self.sliding_window is None:
            return 0
        return max(num_computed_tokens - self.sliding_window + 1, 0) // block_size

    def max_live_blocks(self, num_tokens: int, block_size: int, chunk_tokens: int = 1) -> int:
        """The most blocks one sequence of `num_tokens` tokens holds in this group at once
        when it computes at most `chunk_tokens` a step. A sliding group holds the blocks of
        the window behind the step's first query, the step's own, and one block of slack
        (blocks go back when a block fills, not at every token)."""
        total = cdiv(num_tokens, block_size)
        if self.sliding_window is None:
            return total
        return min(total, cdiv(self.sliding_window - 1, block_size) + cdiv(chunk_tokens, block_size) + 1)


@dataclass(frozen=True)
class KVLayout:
    """The groups of a model's layers and each layer's place: group and layer slot."""

    groups: tuple[KVGroupSpec, ...]
    layers_per_group: int

    @property
    def num_layers(self) -> int:
        return len(self.groups) * self.layers_per_group

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def frees_blocks(self) -> bool:
        """Does some group give blocks back while its sequence runs (its tables then hold
        the null block where blocks were released)?"""
        return any(g.frees_blocks for g in self.groups)

    def place(self, layer: int) -> tuple[int, int]:
        """(group index, layer slot) of `layer`."""
        for gi, group in enumerate(self.groups):
            if layer in group.layer_ids:
                return gi, group.layer_ids.index(layer)
        raise IndexError(f"layer {layer} is in no group")

    def places(self) -> list[tuple[int, int]]:
        """(group, slot) of every layer, by layer index."""
        return [self.place(layer) for layer in range(self.num_layers)]

    def max_live_blocks(self, num_tokens: int, block_size: int, chunk_tokens: int = 1) -> int:
        """Blocks of the pool one sequence holds at most, over all its groups."""
        return sum(g.max_live_blocks(num_tokens, block_size, chunk_tokens) for g in self.groups)

    def describe(self) -> str:
        kinds = [g.kind if g.sliding_window is None else f"{g.kind}({g.sliding_window})" for g in self.groups]
        return f"{len(self.groups)} group(s) of {self.layers_per_group} layer(s): {', '.join(kinds)}"


def full_layout(num_layers: int) -> KVLayout:
    """Every layer full attention: one group, one table (the plain layout)."""
    return KVLayout((KVGroupSpec(FULL_ATTENTION, tuple(range(num_layers))),), num_layers)


def layout_for_windows(windows: Sequence[int | None]) -> KVLayout:
    """The layout for per-layer sliding windows (None: full attention): layers grouped by
    (kind, window), each kind's layers cut in runs of gcd(counts) layers, in layer order;
    full-attention groups first."""
    num_layers = len(windows)
    if num_layers == 0:
        raise ValueError("a model needs at least one layer")
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_window.setdefault(window, []).append(layer)
    size = 0
    for layers in by_window.values():
        size = gcd(size, len(layers))
    groups: list[KVGroupSpec] = []
    for window in sorted(by_window, key=lambda w: (w is not None, w or 0)):
        layers = by_window[window]
        kind = FULL_ATTENTION if window is None else SLIDING_WINDOW
        for i in range(0, len(layers), size):
            groups.append(KVGroupSpec(kind, tuple(layers[i : i + size]), window))
    return KVLayout(tuple(groups), size)
