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
from kv.transfer import gather_blocks, scatter_blocks
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


def is_group_table(table: Any) -> bool:
    """A table of several KV groups (a list of per-group id lists), not one list of ids."""
    return bool(table) and isinstance(table[0], list)


def flat_table(table: Any) -> list[int]:
    """Position-major ids ([g0[0], g1[0], ..., g0[1], ...]; one group: the list itself), the
    form a table crosses to other tensor-parallel ranks in."""
    if not is_group_table(table):
        return list(table)
    return [block for position in zip(*table) for block in position]


def unflat_table(flat: list[int], num_groups: int) -> Any:
    return flat if num_groups == 1 else [flat[g::num_groups] for g in range(num_groups)]


def gather_table(kv: torch.Tensor, layout: KVLayout, table: Any) -> torch.Tensor:
    """A request's KV in model layer order, (num_layers, 2, len * block_size, Hkv, D), from
    its table (one id list, or one per group). A sliding group's released entries read the
    null block: positions no query reads again."""
    if layout.num_groups == 1:
        return gather_blocks(kv, table)
    parts = [gather_blocks(kv, ids) for ids in table]
    out = parts[0].new_empty((layout.num_layers, *parts[0].shape[1:]))
    for group, part in zip(layout.groups, parts):
        out[list(group.layer_ids)] = part
    return out


def scatter_table(kv: torch.Tensor, layout: KVLayout, table: Any, data: torch.Tensor) -> None:
    """Write KV in model layer order (gather_table's form) into a request's table."""
    if layout.num_groups == 1:
        scatter_blocks(kv, table, data)
        return
    for group, ids in zip(layout.groups, table):
        scatter_blocks(kv, ids, data[list(group.layer_ids)])


def table_prefix(table: Any, num_blocks: int) -> Any:
    """The first `num_blocks` entries of a table (of every group's)."""
    return [ids[:num_blocks] for ids in table] if is_group_table(table) else table[:num_blocks]


def table_length(table: Any) -> int:
    """Entries (positions) of a table."""
    return len(table[0]) if is_group_table(table) else len(table)
