"""One request's way through the simulated cluster (mixed or disaggregated):

    mixed:          router ─> replica (the whole request) ─> finished
    disaggregated:  router ─> prefill replica (max_tokens=1, KV export pinned)
                    ─> router ─> decode replica: slot held, KV transfer time, then the
                       engine's real KV import; the prefill copy is released ─> finished

Every output a replica delivers comes through `on_output`: the tracker timestamps its
tokens on the virtual clock, and a finished stage tells the router's policy
(on_complete) and lets queued requests retry for the freed slot.
"""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from cluster.sim.disagg import DisaggOptions
from cluster.sim.ingress import Pending, SimRouter
from cluster.sim.lora import sim_lora_path
from cluster.sim.metrics import RequestRecord
from cluster.sim.replica import SimReplica
from cluster.workload.sim_kinds import SimRequest
from kv.transfer import KVExport
from router.routing.policies import RoutingRequest
from router.routing.types import request_hash_root
from worker.api import RequestOutput
from worker.api import SamplingParams

if TYPE_CHECKING:
    from cluster.sim.run import Simulation


def routing_request(req: SimRequest) -> RoutingRequest:
    """What the ingress hands its router: an adapter request's prompt hashes from the
    adapter's root (as the engine does), so prefix credit counts only its own blocks."""
    if req.lora_name is None:
        return RoutingRequest(req.request_id, req.prompt_token_ids, req.max_tokens, req.session_id)
    root = request_hash_root((), req.lora_name, sim_lora_path(req.lora_name))
    return RoutingRequest(req.request_id, req.prompt_token_ids, req.max_tokens, req.session_id, root, req.lora_name)


class Flight:
    __slots__ = ("export", "prefill_replica", "record", "replica", "request", "router", "routing_request", "stage")

    def __init__(self, request: SimRequest, router: SimRouter) -> None:
        self.request = request
        self.router = router
        self.record: RequestRecord | None = None
        self.routing_request: RoutingRequest | None = None
        self.stage = "mixed"
        self.replica: SimReplica | None = None
        self.export: KVExport | None = None
        self.prefill_replica: SimReplica | None = None


class Orchestrator:
    def __init__(self, sim: Simulation, options: DisaggOptions, kv_bytes_per_token: int) -> None:
        self.sim = sim
        self.options = options
        self.kv_bytes_per_token = kv_bytes_per_token
        self.flights: dict[str, Flight] = {}

    def start(self, flight: Flight) -> None:
        req = flight.request
        # Counted from the arrival, not from now: now is later by SimConfig.dispatch_latency_s.
        flight.record = self.sim.tracker.add(req.request_id, req.arrival_s, len(req.prompt_token_ids),
                                             req.max_tokens, req.warmup)
        flight.record.ingress = flight.router.index
        flight.routing_request = routing_request(req)
        self.flights[req.request_id] = flight
        self._route(flight, "prefill" if self.options.enabled else "mixed")

    def _route(self, flight: Flight, stage: str) -> None:
        flight.stage = stage
        flight.router.submit(stage, Pending(flight.routing_request, partial(self._dispatch, flight)))

    def _dispatch(self, flight: Flight, replica: SimReplica) -> None:
        req = flight.request
        flight.replica = replica
        rec = flight.record
        assert rec is not None
        self.sim.last_progress_s = self.sim.clock.now
        rec.replica_keys.append(replica.key)
        if rec.dispatch_s is None:
            rec.dispatch_s = self.sim.clock.now
        if flight.stage == "decode":
            replica.num_ongoing += 1  # the slot is held while the KV moves
            num_tokens = flight.export.num_tokens  # type: ignore[union-attr]
            self.sim.clock.after(self.options.transfer_time_s(num_tokens, self.kv_bytes_per_token),
                                 self._import, flight, replica)
            return
        export = flight.stage == "prefill" and req.max_tokens > 1
        params = SamplingParams(max_tokens=1 if export else req.max_tokens, ignore_eos=True)
        error = replica.submit(req.request_id, list(req.prompt_token_ids), params, export_kv=export,
                               profile=flight.routing_request.profile,  # type: ignore[union-attr]
                               lora_name=req.lora_name, session_id=req.session_id)
        if error is not None:
            self._fail(flight, error)

    def _import(self, flight: Flight, replica: SimReplica) -> None:
        req = flight.request
        replica.num_ongoing -= 1  # submit counts it again
        error = replica.submit(req.request_id, list(req.prompt_token_ids),
                               SamplingParams(max_tokens=req.max_tokens, ignore_eos=True), kv_import=flight.export,
                               profile=flight.routing_request.profile,  # type: ignore[union-attr]
                               session_id=req.session_id)
        flight.prefill_replica.release_kv(req.request_id)  # type: ignore[union-attr]
        flight.export = None
        if error is not None:
            self._fail(flight, error)
            self._left(replica)

    def _fail(self, flight: Flight, error: str) -> None:
        replica = flight.replica
        assert replica is not None
        flight.router.complete(replica.role, flight.request.request_id, replica.key)
        self.sim.tracker.finish(flight.record, self.sim.clock.now, "error", error)  # type: ignore[arg-type]
        self.flights.pop(flight.request.request_id, None)

    def on_output(self, replica: SimReplica, out: RequestOutput, now: float) -> None:
        flight = self.flights.get(out.request_id)
        if flight is None:
            return
        rec = flight.record
        assert rec is not None
        self.sim.last_progress_s = now
        self.sim.tracker.on_tokens(rec, out, now)
        if not out.finished:
            return
        flight.router.complete(replica.role, out.request_id, replica.key)
        export = out.extra.pop("kv_export", None)
        if export is not None and out.error is None and flight.stage == "prefill":
            flight.export = export
            flight.prefill_replica = replica
            self._route(flight, "decode")
        else:
            self.sim.tracker.finish(rec, now, out.finish_reason, out.error)
            del self.flights[out.request_id]
        self._left(replica)

    def _left(self, replica: SimReplica) -> None:
        """A request left `replica`: a draining replica may go now; queued requests retry."""
        if replica.draining and replica.num_ongoing == 0 and replica.removed_at is None:
            self.sim.remove(replica)
        self.sim.pools[replica.role].slot_freed()
