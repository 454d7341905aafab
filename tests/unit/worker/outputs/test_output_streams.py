"""worker/outputs/streams.py: one ingress's outputs on a worker replica, drained as lists.

Pinned: a reader gets the whole backlog in one list; outputs of one request that wait
together become one object (tokens, text and logprobs in order, the later state); a
holding request (a non-streamed response) sends its first output and then only the
finished one; a stream ends once nothing is pending and no request is in flight."""
from __future__ import annotations

import asyncio

from worker.api import RequestOutput, TokenLogprob
from worker.outputs.streams import OutputStreams


def out(request_id: str, token: int, finished: bool = False, n: int = 0) -> RequestOutput:
    return RequestOutput(request_id, [token], text_delta=f"<{token}>", finished=finished,
                         finish_reason="length" if finished else None, num_output_tokens=n,
                         logprobs=[TokenLogprob(token, -0.5)])


async def drain_now(streams: OutputStreams, stream_id: str) -> list[list[RequestOutput]]:
    """Everything the stream yields until it ends (the caller closed every request)."""
    return [batch async for batch in streams.drain(stream_id)]


def test_absorb_keeps_order_and_the_later_state() -> None:
    first = RequestOutput("r", [1], "a", num_output_tokens=1, first_token_time=5.0, prompt_logprobs=[None],
                          logprobs=[TokenLogprob(1, -0.1)])
    first.absorb(RequestOutput("r", [2, 3], "bc", finished=True, finish_reason="stop", stop_reason=3,
                               num_output_tokens=3, first_token_time=9.0, logprobs=[TokenLogprob(2, -0.2), TokenLogprob(3, -0.3)]))
    assert first.new_token_ids == [1, 2, 3] and first.text_delta == "abc"
    assert [lp.token_id for lp in first.logprobs or []] == [1, 2, 3]
    assert (first.finished, first.finish_reason, first.stop_reason, first.num_output_tokens) == (True, "stop", 3, 3)
    assert first.first_token_time == 5.0 and first.prompt_logprobs == [None]


async def test_waiting_outputs_leave_as_one_list_one_object_per_request() -> None:
    streams = OutputStreams()
    for rid in ("a", "b"):
        streams.open_request("s", rid)
    for step in range(3):  # three steps before anyone reads
        streams.put("s", out("a", 10 + step, n=step + 1))
        streams.put("s", out("b", 20 + step, n=step + 1))
    assert streams.num_pending("s") == 2
    streams.close_request("s", "a")
    streams.close_request("s", "b")
    batches = await asyncio.wait_for(drain_now(streams, "s"), timeout=5)
    assert len(batches) == 1 and [o.request_id for o in batches[0]] == ["a", "b"]
    a, b = batches[0]
    assert a.new_token_ids == [10, 11, 12] and a.text_delta == "<10><11><12>" and a.num_output_tokens == 3
    assert b.new_token_ids == [20, 21, 22]


async def test_a_holding_request_sends_its_first_output_then_only_the_finished_one() -> None:
    streams = OutputStreams()
    streams.open_request("s", "plain", hold=True)
    reader = asyncio.ensure_future(drain_now(streams, "s"))
    streams.put("s", out("plain", 1, n=1))
    await asyncio.sleep(0)  # the reader takes the first output alone
    for token in range(2, 6):
        streams.put("s", out("plain", token, n=token))
    await asyncio.sleep(0)
    assert streams.num_pending("s") == 0  # held, not pending
    streams.put("s", out("plain", 6, finished=True, n=6))
    streams.close_request("s", "plain")
    batches = await asyncio.wait_for(reader, timeout=5)
    sent = [o for batch in batches for o in batch]
    assert [o.new_token_ids for o in sent] == [[1], [2, 3, 4, 5, 6]]
    assert sent[-1].finished and sent[-1].num_output_tokens == 6


async def test_the_stream_ends_when_idle_and_a_new_request_waits_for_the_next_reader() -> None:
    streams = OutputStreams()
    streams.open_request("s", "a")
    reader = asyncio.ensure_future(drain_now(streams, "s"))
    streams.put("s", out("a", 1, finished=True, n=1))
    streams.close_request("s", "a")
    assert [len(b) for b in await asyncio.wait_for(reader, timeout=5)] == [1]
    streams.open_request("s", "b")  # no reader now: its outputs wait in the outbox
    streams.put("s", out("b", 2, finished=True, n=1))
    streams.close_request("s", "b")
    assert [[o.request_id for o in b] for b in await asyncio.wait_for(drain_now(streams, "s"), timeout=5)] == [["b"]]
    assert not streams._outboxes  # nothing left behind


async def test_a_request_that_ends_without_finishing_drops_what_it_held() -> None:
    streams = OutputStreams()
    streams.open_request("s", "x", hold=True)
    streams.put("s", out("x", 1, n=1))
    streams.put("s", out("x", 2, n=2))  # folded into the pending first output
    batches = [b async for b in _take(streams, "s", 1)]
    streams.put("s", out("x", 3, n=3))  # held
    streams.close_request("s", "x")  # failed: its own call carries the error
    assert [o.new_token_ids for b in batches for o in b] == [[1, 2]]
    assert await asyncio.wait_for(drain_now(streams, "s"), timeout=5) == []


async def _take(streams: OutputStreams, stream_id: str, n: int):  # type: ignore[no-untyped-def]
    gen = streams.drain(stream_id)
    for _ in range(n):
        yield await gen.__anext__()
    await gen.aclose()


async def test_pacing_sends_first_and_finished_outputs_at_once_and_folds_the_rest() -> None:
    """With an interval far longer than the test, only urgency moves outputs: a request's
    first output leaves at once, the next ones wait (folded into one), and its finished
    output takes them along."""
    streams = OutputStreams(interval_s=3600.0)
    streams.open_request("s", "r")
    got: list[list[RequestOutput]] = []

    async def read() -> None:
        async for batch in streams.drain("s"):
            got.append(batch)

    reader = asyncio.ensure_future(read())
    streams.put("s", out("r", 1, n=1))
    await _until(lambda: len(got) == 1)
    for token in (2, 3, 4):
        streams.put("s", out("r", token, n=token))
    for _ in range(10):
        await asyncio.sleep(0)
    assert len(got) == 1 and streams.num_pending("s") == 1  # waiting for its interval, folded
    streams.put("s", out("r", 5, finished=True, n=5))
    streams.close_request("s", "r")
    await asyncio.wait_for(reader, timeout=5)
    assert [[o.new_token_ids for o in batch] for batch in got] == [[[1]], [[2, 3, 4, 5]]]


async def _until(predicate) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(5):
        while not predicate():
            await asyncio.sleep(0)
