"""Projections kept quantized on the device (worker/model/quant/fp8_linear.py, int4_linear.py):
every column- and row-parallel projection of the decoder layers becomes its quantized form,
empty, before the checkpoint is loaded into it. The form is a class made once per (format
base, projection class), so that a QKVParallelLinear keeps its own attributes."""
from __future__ import annotations

from collections.abc import Callable

from torch import nn

from worker.model.parallel import ColumnParallelLinear, RowParallelLinear

_CLASSES: dict[tuple[type, type], type] = {}


def _quantized_class(prefix: str, base: type, cls: type) -> type:
    if (base, cls) not in _CLASSES:
        _CLASSES[(base, cls)] = type(f"{prefix}{cls.__name__}", (base, cls), {})
    return _CLASSES[(base, cls)]


def convert_projections(model: nn.Module, prefix: str, column: type, row: type, marker: type,
                        make_empty: Callable[[nn.Module], None]) -> int:
    """Give every decoder-layer projection not yet converted (`marker`) the class `column`
    or `row` mixes in, then `make_empty(module)` its quantized storage. Returns how many."""
    converted = 0
    for name, module in model.named_modules():
        if not name.startswith("layers.") or isinstance(module, marker):
            continue
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            base = column if isinstance(module, ColumnParallelLinear) else row
            module.__class__ = _quantized_class(prefix, base, type(module))
            make_empty(module)
            converted += 1
    return converted
