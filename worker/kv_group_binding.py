"""The model runner's side of KV groups (kv/kv_groups.py): which layout a model gets, each
layer's view of the KV tensor, and each layer's attention reading its group's tables.

With one group nothing changes: the KV tensor is (num_layers, 2, blocks, block_size, Hkv, D),
layer i reads kv[i], every layer reads the one AttentionMetadata. With several groups:

    kv tensor:   (layers_per_group, 2, num_blocks, block_size, Hkv, D)
    layer i:     cache kv[slot(i)], metadata meta.groups[group(i)]
    meta:        group 0's AttentionMetadata, its `groups` listing every group's (each with
                 its own slot mapping and block tables, from the group's block ids)

Models need not know: the runner passes a list of per-layer cache views (indexed like the
tensor) and wraps each layer's attention backend in a GroupBackend that picks its group's
metadata. A model's layers are found as `model.layers[i]`, their attention as any module
under it with a `backend` attribute.
"""
from __future__ import annotations

from typing import Any

import torch

from kv.kv_groups import KVLayout, full_layout, layout_for_windows
from worker.attention.base import AttentionMetadata


def model_kv_layout(arch: Any) -> KVLayout:
    """The layout for a model's arch: from its per-layer sliding windows when it has them."""
    windows = tuple(getattr(arch, "sliding_windows", ()) or ())
    if not windows or all(w is None for w in windows):
        return full_layout(arch.num_layers)
    return layout_for_windows(windows)


class GroupBackend:
    """An attention backend bound to one KV group: it hands the wrapped backend that
    group's metadata (or the metadata itself when it has no groups: a profile forward)."""

    def __init__(self, inner: Any, group: int) -> None:
        self.inner = inner
        self.group = group
        self.name = inner.name
        self.varlen = inner.varlen

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                **kwargs: Any) -> torch.Tensor:
        own = meta.groups[self.group] if meta.groups is not None else meta
        return self.inner.forward(q, k, v, kv_cache, own, scale, sliding_window, **kwargs)


def bind_groups(model: torch.nn.Module, layout: KVLayout) -> None:
    """Wrap every layer's attention backend in its group's GroupBackend (several groups only)."""
    if layout.num_groups == 1:
        return
    places = layout.places()
    for i, layer in enumerate(model.layers):
        group = places[i][0]
        for module in layer.modules():
            backend = getattr(module, "backend", None)
            if backend is not None and not isinstance(backend, GroupBackend):
                module.backend = GroupBackend(backend, group)


def layer_caches(kv: torch.Tensor, layout: KVLayout) -> torch.Tensor | list[torch.Tensor]:
    """What the model indexes by layer: the tensor itself with one group, else each layer's
    slot view."""
    if layout.num_groups == 1:
        return kv
    return [kv[slot] for _, slot in layout.places()]


def group_table_tensor(tables: list[list[list[int]]], num_groups: int) -> torch.Tensor:
    """(num_groups, S, max_blocks) block ids from each row's per-group tables, padded with 0."""
    max_blocks = max(len(t[0]) for t in tables)
    rows = [[row + [0] * (max_blocks - len(row)) for row in t] for t in tables]
    return torch.tensor(rows, dtype=torch.long).reshape(len(tables), num_groups, max_blocks).transpose(0, 1)
