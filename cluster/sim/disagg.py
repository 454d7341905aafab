"""Prefill/decode disaggregation in the simulator: pool sizes and the KV-transfer model.

A request prefills on a prefill replica (the real engine, max_tokens=1, KV exported and
its blocks pinned), its KV moves to a decode replica, which imports it through the
engine's real import path (admission, block allocation, prefix-cache registration) and
decodes the rest. The transfer takes

    time = prompt tokens * kv_bytes_per_token / link_bandwidth + link_latency

(the model shape's KV bytes per token: K and V, every layer and KV head, at its dtype).
The decode replica is chosen when the prefill finishes and holds a slot from then on;
the prefill replica's pinned blocks are released when the transfer completes.
"""
from __future__ import annotations

from dataclasses import dataclass

# A 400 Gb/s RDMA NIC per GPU (H200 / H100 nodes), as bytes/s, and one RDMA round trip.
DEFAULT_LINK_BANDWIDTH = 50e9
DEFAULT_LINK_LATENCY_S = 0.0005


@dataclass(frozen=True)
class DisaggOptions:
    prefill_replicas: int = 0
    decode_replicas: int = 0
    link_bandwidth: float = DEFAULT_LINK_BANDWIDTH  # bytes/s
    link_latency_s: float = DEFAULT_LINK_LATENCY_S

    def __post_init__(self) -> None:
        if (self.prefill_replicas > 0) != (self.decode_replicas > 0):
            raise ValueError("disaggregation needs both prefill_replicas and decode_replicas >= 1")
        if self.link_bandwidth <= 0 or self.link_latency_s < 0:
            raise ValueError("link_bandwidth must be > 0 and link_latency_s >= 0")

    @property
    def enabled(self) -> bool:
        return self.prefill_replicas > 0

    def num_replicas(self, role: str) -> int:
        return self.prefill_replicas if role == "prefill" else self.decode_replicas

    def transfer_time_s(self, num_tokens: int, kv_bytes_per_token: int) -> float:
        return num_tokens * kv_bytes_per_token / self.link_bandwidth + self.link_latency_s
