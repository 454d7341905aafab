"""LoRA adapters a router sent to each replica that the replica's last report cannot show
yet (pure Python). The headroom policy reads a replica's adapters as its report's plus
these: a burst of requests for adapters a replica lacks, sent within one stats period,
would otherwise each see the same free slots and all go there, and a second request for an
adapter just sent would be priced a load it will not need.

    sent(r)      = {adapter: time of this router's latest dispatch of it to r}
    unseen(r, t) = the adapters of sent(r) dispatched after t, the report's timestamp
                   (older ones are in that report, or finished: the report is the truth)

Each router keeps its own (not in the shared routing view): with several ingress routers
each sees only the adapters it sent itself.
"""
from __future__ import annotations

from dataclasses import replace

from router.routing.types import ReplicaKey, ReplicaReport


class SentAdapters:
    def __init__(self) -> None:
        self._sent: dict[ReplicaKey, dict[str, float]] = {}

    def sent(self, replica: ReplicaKey, name: str, now: float) -> None:
        self._sent.setdefault(replica, {})[name] = now

    def unseen(self, replica: ReplicaKey, report: ReplicaReport) -> frozenset[str]:
        """Adapters sent after the report was taken (those before are dropped for good)."""
        sent = self._sent.get(replica)
        if not sent:
            return frozenset()
        for name in [n for n, t in sent.items() if t < report.timestamp]:
            del sent[name]
        return frozenset(sent)

    def forget(self, replica: ReplicaKey) -> None:
        self._sent.pop(replica, None)

    def with_unseen(self, replica: ReplicaKey, report: ReplicaReport) -> ReplicaReport:
        """The report with the unseen adapters resident and active (each holds a slot once
        its request runs)."""
        unseen = self.unseen(replica, report)
        if not unseen:
            return report
        return replace(report, lora_resident=report.lora_resident | unseen, lora_active=report.lora_active | unseen)
