"""A step's small inputs reach the device in one copy per dtype, from pinned host memory.

A step's inputs are several short tensors (ids, positions, slots, the sampling rows, the
varlen lengths). Copied one by one from pageable memory, each copy is staged by the
driver and holds the host; from pinned memory a copy is queued and the host goes on.
Here they are packed into one pinned buffer per dtype and copied once, and the device
side is split into views.

    pinned ring (depth D): buffer k serves steps k, k+D, k+2D, ...
      [ part 0 | part 1 | ... ]   one dtype, packed in call order
    before buffer k is rewritten, the event recorded after its last copy is waited on
    (normally long done: D steps have passed)

On a CPU device there is nothing to copy: the parts are returned as they are.
"""
from __future__ import annotations

import torch


class _Ring:
    """D pinned buffers of one dtype, each with the event of its last copy."""

    def __init__(self, dtype: torch.dtype, depth: int, capacity: int, pin: bool) -> None:
        self.dtype, self.pin = dtype, pin
        self.buffers = [self._new(capacity) for _ in range(depth)]
        self.events: list[torch.cuda.Event | None] = [None] * depth
        self.next = 0

    def _new(self, capacity: int) -> torch.Tensor:
        return torch.empty(capacity, dtype=self.dtype, pin_memory=self.pin)

    def take(self, numel: int) -> tuple[int, torch.Tensor]:
        """The next buffer, free to write (grown when too small)."""
        k = self.next
        self.next = (k + 1) % len(self.buffers)
        event = self.events[k]
        if event is not None:
            event.synchronize()
        if self.buffers[k].numel() < numel:
            self.buffers[k] = self._new(max(numel, 2 * self.buffers[k].numel()))
        return k, self.buffers[k]


class InputStaging:
    """Packs a step's host tensors per dtype into a pinned ring and copies each pack once."""

    def __init__(self, device: torch.device, capacity: int = 4096, depth: int = 3, pack_on_cpu: bool = False) -> None:
        self.device = device
        self._packs = device.type == "cuda" or pack_on_cpu
        self._pin = device.type == "cuda"
        self._capacity, self._depth = capacity, depth
        self._rings: dict[torch.dtype, _Ring] = {}

    def upload(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parts on the device, in order (1-D host tensors of any integer or float dtype)."""
        if not self._packs:
            return parts
        out: list[torch.Tensor | None] = [None] * len(parts)
        for dtype in dict.fromkeys(p.dtype for p in parts):
            idx = [i for i, p in enumerate(parts) if p.dtype == dtype]
            for i, view in zip(idx, self._upload_one(dtype, [parts[i] for i in idx])):
                out[i] = view
        return out  # type: ignore[return-value]

    def _upload_one(self, dtype: torch.dtype, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        ring = self._rings.get(dtype)
        if ring is None:
            ring = self._rings[dtype] = _Ring(dtype, self._depth, self._capacity, self._pin)
        sizes = [p.numel() for p in parts]
        total = sum(sizes)
        k, host = ring.take(total)
        packed = host[:total]
        torch.cat([p.reshape(-1) for p in parts], out=packed)
        device = packed.to(self.device, non_blocking=True) if self.device.type != "cpu" else packed.clone()
        if self._pin:
            event = torch.cuda.Event()
            event.record()
            ring.events[k] = event
        return [v.view(p.shape) for v, p in zip(device.split(sizes), parts)]
