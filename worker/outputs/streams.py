"""Batched output streams: a worker replica's outputs leave once per step per ingress, not
once per token per request.

An ingress process names one output stream (`GenerateRequest.output_stream`) for all the
requests it sends. On the worker, each of those requests' outputs is appended to that
stream's outbox as the engine publishes them; one long-lived `outputs(stream_id)` call per
(ingress, worker replica) drains the outbox, so everything a step produced for that
ingress crosses Ray as ONE list:

    engine step N ──publish──> outbox[stream].items += [out(r1), out(r2), ... out(r64)]
                                        │  (one event-loop turn later)
    outputs(stream) generator ──yield──> [out(r1) ... out(r64)]  ──Ray──>  ingress demux

The per-request `generate` call stays open as the request's lifecycle (Serve's routing,
queue length, cancellation -> abort, replica failure -> migration) but carries no tokens.

Pacing: a list leaves at once when it carries a request's first output (time to first
token) or a finished one; otherwise at most one list per `interval_s` per stream, each
request's outputs in between folded into one (RequestOutput.absorb). Every object that
crosses Ray, and every chunk the ingress writes, then carries several steps' tokens when
steps are faster than the interval; 0 sends every step's outputs as they come.

An outbox's stream ends when it has nothing left to deliver and no request in flight, so
a replica being drained is never held open by an idle stream; the ingress opens it again
when it sends that replica its next request. Outputs produced while no stream is open wait
in the outbox.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from worker.api import RequestOutput


@dataclass
class Outbox:
    """One ingress's pending outputs on this replica, and its requests in flight."""

    items: list[RequestOutput] = field(default_factory=list)
    # Where each request's output waits in `items`: a request's next output is folded into
    # it (RequestOutput.absorb), so a reader slower than the steps gets one object per
    # request per read, however many steps passed.
    index: dict[str, int] = field(default_factory=dict)
    active: set[str] = field(default_factory=set)  # request ids whose outputs may still come
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    # Requests whose caller reads only the final text (a non-streamed response): after
    # their first output (time to first token), what comes is folded here and leaves with
    # the finished one. None of it is lost to the client; migration resumes from the first.
    # (Most make no output in between at all: the engine runs them quiet, Engine.add_request.)
    holding: set[str] = field(default_factory=set)
    held: dict[str, RequestOutput] = field(default_factory=dict)
    started: set[str] = field(default_factory=set)  # requests whose first output was queued
    urgent: bool = False  # `items` holds a first or a finished output: send now
    last_sent: float = -float("inf")  # time.monotonic() of the last list

    @property
    def idle(self) -> bool:
        return not self.items and not self.active


class OutputStreams:
    """The outboxes of one worker replica, by stream id. Event-loop side only."""

    def __init__(self, interval_s: float = 0.0) -> None:
        self.interval_s = interval_s
        self._outboxes: dict[str, Outbox] = {}
        self._readers: dict[str, int] = {}  # open outputs() calls per stream

    def open_request(self, stream_id: str, request_id: str, hold: bool = False) -> None:
        """`hold`: the caller wants the first output and then only the finished one."""
        box = self._outbox(stream_id)
        box.active.add(request_id)
        if hold:
            box.holding.add(request_id)

    def put(self, stream_id: str, output: RequestOutput) -> None:
        box = self._outbox(stream_id)
        request_id = output.request_id
        i = box.index.get(request_id)
        if i is not None:  # its previous output has not left yet: one object
            box.items[i].absorb(output)
            if output.finished:
                box.urgent = True
                box.ready.set()
            return
        first = request_id not in box.started
        if request_id in box.holding:
            if not first and not output.finished:
                held = box.held.get(request_id)
                if held is None:
                    box.held[request_id] = output
                else:
                    held.absorb(output)
                return
            held = box.held.pop(request_id, None)
            if held is not None:
                held.absorb(output)
                output = held
        box.started.add(request_id)
        was_empty = not box.items
        box.index[request_id] = len(box.items)
        box.items.append(output)
        if first or output.finished:
            box.urgent = True
            box.ready.set()
        elif was_empty:
            box.ready.set()  # the reader paces it

    def close_request(self, stream_id: str, request_id: str) -> None:
        """The request sends nothing more (finished, failed or aborted)."""
        box = self._outboxes.get(stream_id)
        if box is None:
            return
        box.active.discard(request_id)
        box.holding.discard(request_id)
        box.started.discard(request_id)
        box.held.pop(request_id, None)  # ended without finishing: its call raised the error
        box.ready.set()  # a reader may be waiting to end the stream
        self._forget_if_done(stream_id)

    async def drain(self, stream_id: str) -> AsyncIterator[list[RequestOutput]]:
        """Yield the outbox's outputs as lists, each the whole backlog at that moment; end
        once nothing is pending and no request is in flight."""
        box = self._outbox(stream_id)
        self._readers[stream_id] = self._readers.get(stream_id, 0) + 1
        try:
            while True:
                if box.items:
                    wait = box.last_sent + self.interval_s - time.monotonic()
                    if wait > 0 and not box.urgent:
                        box.ready.clear()
                        try:  # only a first or finished output wakes it early
                            await asyncio.wait_for(box.ready.wait(), wait)
                        except TimeoutError:
                            pass
                        continue
                    batch, box.items = box.items, []
                    box.index.clear()
                    box.urgent = False
                    box.last_sent = time.monotonic()
                    yield batch
                    continue
                if not box.active:
                    return
                box.ready.clear()
                await box.ready.wait()
        finally:
            self._readers[stream_id] -= 1
            if not self._readers[stream_id]:
                del self._readers[stream_id]
            self._forget_if_done(stream_id)

    def num_pending(self, stream_id: str) -> int:
        box = self._outboxes.get(stream_id)
        return 0 if box is None else len(box.items)

    def _outbox(self, stream_id: str) -> Outbox:
        box = self._outboxes.get(stream_id)
        if box is None:
            box = self._outboxes[stream_id] = Outbox()
        return box

    def _forget_if_done(self, stream_id: str) -> None:
        box = self._outboxes.get(stream_id)
        if box is not None and box.idle and stream_id not in self._readers:
            del self._outboxes[stream_id]
