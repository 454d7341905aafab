"""Where a `run_into` request's outputs go on the event loop (AsyncEngine.run_into): each is
handled in the loop turn that delivers its step, with no task woken per output, unlike the
queue a `generate` iterator reads.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from worker.api import RequestOutput
from worker.outputs.processor import RequestOutputProcessor


class OutputSink:
    """A `run_into` request's outputs, handled where they are delivered: detokenized, handed
    on, and its end noted (a stop string ends it in the core too)."""

    def __init__(self, processor: RequestOutputProcessor, on_output: Callable[[RequestOutput], None],
                 done: asyncio.Future[None], abort: Callable[[], None]) -> None:
        self.processor, self.on_output, self.done, self._abort = processor, on_output, done, abort
        self.finished = False

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        if self.done.done():
            return
        if isinstance(item, BaseException):
            self.done.set_exception(item)
            return
        out = self.processor.process(item)
        if out.finished:
            self.finished = True
            if self.processor.stopped:
                self._abort()
        try:
            self.on_output(out)
        except BaseException as e:  # the consumer refused it: fail the request there
            self.done.set_exception(e)
            return
        if out.finished:
            self.done.set_result(None)
