"""Where a request's outputs go on the event loop (AsyncEngine.run_into): each is handled in
the loop turn that delivers its step, with no task woken per output. A caller that wants an
iterator instead (AsyncEngine.generate) puts `iterate` in front: one queue, one task.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from worker.api import RequestOutput
from worker.outputs.processor import RequestOutputProcessor


class OutputSink:
    """A `run_into` request's outputs, handled where they are delivered: detokenized, handed
    on, and its end noted (a stop string ends it in the core too). `export_kv`: the prefill
    half of a disaggregated request, whose max_tokens=1 end is not the request's."""

    def __init__(self, processor: RequestOutputProcessor, on_output: Callable[[RequestOutput], None],
                 done: asyncio.Future[None], abort: Callable[[], None], export_kv: bool = False,
                 on_end: Callable[[], None] | None = None) -> None:
        self.processor, self.on_output, self.done, self._abort = processor, on_output, done, abort
        self.export_kv = export_kv
        self._on_end = on_end  # the request's bookkeeping, before its caller sees the end
        self.finished = False

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        if self.done.done():
            return
        if isinstance(item, BaseException):
            self._end()
            self.done.set_exception(item)
            return
        # The prefill half: max_tokens=1 ended it here, not the request. No final flush: the
        # decode side continues the text (held-back characters and stop-string prefixes
        # included); the core has finished it and its KV stays pinned.
        handed_over = self.export_kv and item.finish_reason == "length" and bool(item.new_token_ids)
        if handed_over:
            item.finished, item.finish_reason = False, None
        out = self.processor.process(item)
        if out.finished and self.processor.stopped:
            self._abort()  # a stop string ended it: the core does not know stop strings
        ends = out.finished or handed_over
        self.finished = self.finished or ends
        if ends:
            self._end()
        try:
            self.on_output(out)
        except BaseException as e:  # the consumer refused it: fail the request there
            self.done.set_exception(e)
            return
        if ends:
            self.done.set_result(None)


    def _end(self) -> None:
        if self._on_end is not None:
            on_end, self._on_end = self._on_end, None
            on_end()


async def iterate(run: Callable[[Callable[[RequestOutput], None]], Awaitable[None]]) -> AsyncIterator[RequestOutput]:
    """A call that hands its outputs to a callback, as an async iterator: `run(put)` runs as
    a task whose outputs are yielded in order; the iteration ends with a finished output
    (as a queue-fed stream does, without waiting for the task to wind down), or when the
    task ends, raising its error if it failed. Leaving the iteration early cancels the task
    (for `run_into`: an abort)."""
    outputs: asyncio.Queue[RequestOutput | object] = asyncio.Queue()
    end = object()
    task = asyncio.ensure_future(run(outputs.put_nowait))
    task.add_done_callback(lambda _: outputs.put_nowait(end))
    finished = False
    try:
        while (item := await outputs.get()) is not end:
            assert isinstance(item, RequestOutput)
            finished = item.finished
            yield item
            if finished:
                return
        task.result()
    finally:
        if not finished and not task.done():
            task.cancel()
