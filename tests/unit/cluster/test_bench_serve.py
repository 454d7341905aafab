"""`kvserve bench serve` (cluster/bench_serve.py, cluster/bench/) without Ray: metric
computation on hand-made timings, seeded Poisson arrivals, workload structure, and whole
runs against a small fake OpenAI SSE server (starlette on uvicorn, 127.0.0.1, a port of
its own, in the test's event loop)."""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import socket
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cluster import bench_serve
from cluster.bench import report, run, stream
from cluster.workload import draws
from cluster.workload import text_prompts as workload
from cluster.bench.client import lines, make_client

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


# -- metrics -------------------------------------------------------------------------------
def _done(index: int, ttft: float, e2e: float, out: int, itl: list[float], prompt: int | None, max_tokens: int | None = None) -> stream.RequestResult:
    return stream.RequestResult(
        index=index, success=True, status=200, prompt_len=50, max_tokens=out if max_tokens is None else max_tokens,
        prompt_tokens=prompt, output_tokens=out, ttft_s=ttft, e2e_s=e2e, itl_s=itl, num_chunks=len(itl) + 1,
    )


def hand_made() -> list[stream.RequestResult]:
    # Dyadic times, so that every expected value below is exact in binary floating point.
    return [
        _done(0, 0.25, 1.25, 5, [0.25] * 4, 100),  # TPOT (1.25 - 0.25) / 4 = 0.25
        _done(1, 0.5, 2.5, 9, [0.25] * 8, 200),  # TPOT 2.0 / 8 = 0.25
        _done(2, 0.75, 0.75, 1, [], None),  # one token: no TPOT; no usage -> prompt_len 50
        _done(3, 1.0, 3.0, 3, [0.5, 1.5], 300, max_tokens=4),  # TPOT 2.0 / 2 = 1.0; one short
        stream.RequestResult(index=4, error="HTTP 429", error_detail="server_overloaded: at the limit", status=429),
        stream.RequestResult(index=5, error="ReadTimeout"),
    ]


def test_tpot_of_a_request() -> None:
    r = hand_made()
    assert [x.tpot_s for x in r] == [0.25, 0.25, None, 1.0, None, None]


def test_summarize_hand_made_timings() -> None:
    s = report.summarize(hand_made(), duration_s=2.0)
    assert s["completed"] == 4 and s["failed"] == 2
    assert s["total_input_tokens"] == 100 + 200 + 50 + 300
    assert s["total_output_tokens"] == 5 + 9 + 1 + 3
    assert s["request_throughput"] == 2.0
    assert s["output_throughput"] == 9.0
    assert s["total_token_throughput"] == (650 + 18) / 2.0
    assert s["mean_prompt_len_requested"] == 50.0
    assert s["mean_prompt_tokens"] == 200.0  # the three with usage
    assert s["output_len_mismatches"] == 1
    assert s["goodput"] is None and s["good_requests"] is None

    # TTFT ms: 250, 500, 750, 1000
    assert s["ttft_ms"]["mean"] == 625.0
    assert s["ttft_ms"]["p50"] == 625.0
    assert s["ttft_ms"]["p90"] == pytest.approx(925.0, abs=1e-9)
    assert s["ttft_ms"]["p99"] == pytest.approx(992.5, abs=1e-9)
    assert s["ttft_ms"]["max"] == 1000.0
    # TPOT ms: 250, 250, 1000 (the one-token request has none)
    assert s["tpot_ms"]["mean"] == 500.0
    assert s["tpot_ms"]["p50"] == 250.0
    assert s["tpot_ms"]["p90"] == pytest.approx(850.0, abs=1e-9)
    assert s["tpot_ms"]["p99"] == pytest.approx(985.0, abs=1e-9)
    # ITL ms: twelve 250s, 500, 1500
    assert s["itl_ms"]["mean"] == pytest.approx(5000.0 / 14)
    assert s["itl_ms"]["p50"] == 250.0
    assert s["itl_ms"]["p90"] == pytest.approx(425.0, abs=1e-9)
    assert s["itl_ms"]["p99"] == pytest.approx(1370.0, abs=1e-9)
    # E2E ms: 750, 1250, 2500, 3000
    assert s["e2e_ms"]["mean"] == 1875.0
    assert s["e2e_ms"]["p50"] == 1875.0
    assert s["e2e_ms"]["p90"] == pytest.approx(2850.0, abs=1e-9)
    assert s["e2e_ms"]["p99"] == pytest.approx(2985.0, abs=1e-9)

    assert s["errors"] == {"HTTP 429": 1, "ReadTimeout": 1}
    assert s["error_examples"] == {"HTTP 429": "server_overloaded: at the limit"}
    json.dumps(s, allow_nan=False)  # plain JSON


@pytest.mark.parametrize(
    ("slo_ttft_ms", "slo_tpot_ms", "good"),
    [
        (750.0, 250.0, 3),  # 0, 1, 2 (no TPOT: met); 3 misses both
        (500.0, None, 2),  # 0, 1
        (None, 250.0, 3),  # 0, 1, 2
        (1000.0, 1000.0, 4),  # bounds are inclusive
        (100.0, None, 0),
    ],
)
def test_goodput(slo_ttft_ms: float | None, slo_tpot_ms: float | None, good: int) -> None:
    s = report.summarize(hand_made(), duration_s=2.0, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)
    assert s["good_requests"] == good
    assert s["goodput"] == good / 2.0  # failed requests never count


def test_summarize_custom_percentiles_and_nothing_done() -> None:
    s = report.summarize(hand_made(), 2.0, percentiles=[25, 99.9])
    assert set(s["ttft_ms"]) == {"mean", "std", "max", "p25", "p99_9"}
    assert s["ttft_ms"]["p25"] == 437.5
    empty = report.summarize([stream.RequestResult(index=0, error="ConnectError")], 0.5)
    assert empty["completed"] == 0 and empty["request_throughput"] == 0.0
    assert empty["ttft_ms"]["p50"] is None and empty["mean_prompt_tokens"] is None
    text = report.format_summary(empty)
    assert "ConnectError:" in text and "n/a" in text


def test_format_summary_lines() -> None:
    text = report.format_summary(report.summarize(hand_made(), 2.0, slo_ttft_ms=750, slo_tpot_ms=250))
    assert "Successful requests:" in text and "Failed requests:" in text
    assert "Goodput (req/s, TTFT<=750ms TPOT<=250ms):" in text
    for label in ("Mean TTFT (ms):", "P50 TTFT (ms):", "P90 TPOT (ms):", "P99 ITL (ms):", "P99 E2E (ms):"):
        assert label in text
    assert "HTTP 429:" in text and "server_overloaded" in text
    assert "another number of tokens than max_tokens" in text


# -- arrivals ------------------------------------------------------------------------------
def test_poisson_arrivals_seeded_with_the_right_rate() -> None:
    a = draws.arrival_times(20000, request_rate=50.0, seed=3)
    assert a == draws.arrival_times(20000, request_rate=50.0, seed=3)
    assert a != draws.arrival_times(20000, request_rate=50.0, seed=4)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    mean_gap = sum(gaps) / len(gaps)
    assert mean_gap == pytest.approx(1 / 50.0, rel=0.03)  # 1/sqrt(20000) = 0.7% per sigma
    # exponential gaps: std == mean, P(gap > mean) = 1/e
    std = math.sqrt(sum((g - mean_gap) ** 2 for g in gaps) / len(gaps))
    assert std == pytest.approx(mean_gap, rel=0.05)
    assert sum(g > 1 / 50.0 for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.02)


def test_arrivals_inf_and_burstiness() -> None:
    assert draws.arrival_times(5, math.inf) == [0.0] * 5
    assert draws.arrival_times(0, 10.0) == []
    bursty = draws.arrival_times(20000, request_rate=10.0, seed=0, burstiness=0.5)
    gaps = [y - x for x, y in zip(bursty, bursty[1:])]
    mean_gap = sum(gaps) / len(gaps)
    assert mean_gap == pytest.approx(0.1, rel=0.05)  # same mean rate
    std = math.sqrt(sum((g - mean_gap) ** 2 for g in gaps) / len(gaps))
    assert std > 1.2 * mean_gap  # gamma(0.5): cv = sqrt(2)
    with pytest.raises(ValueError):
        draws.arrival_times(3, 0.0)


# -- workloads -----------------------------------------------------------------------------
def test_random_workload_is_seeded_and_sized() -> None:
    w = workload.generate_workload("random", num_prompts=50, seed=1, input_len=100, output_len=20, range_ratio=0.5)
    assert w == workload.generate_workload("random", num_prompts=50, seed=1, input_len=100, output_len=20, range_ratio=0.5)
    assert w != workload.generate_workload("random", num_prompts=50, seed=2, input_len=100, output_len=20, range_ratio=0.5)
    assert [r.index for r in w] == list(range(50))
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.max_tokens <= 30 for r in w)
    assert len({r.prompt_len for r in w}) > 10  # really random
    # one word per token by default
    assert all(len(r.prompt.split()) == r.prompt_len for r in w)
    assert all(word in workload.WORDS for r in w for word in r.prompt.split())
    fixed = workload.generate_workload("random", num_prompts=5, input_len=64, output_len=8)
    assert {(r.prompt_len, r.max_tokens) for r in fixed} == {(64, 8)}


def test_workload_uses_the_calibration() -> None:
    cal = workload.PromptCalibration(tokens_per_word=2.0, overhead_tokens=4.0)
    w = workload.generate_workload("random", num_prompts=3, input_len=104, output_len=8, calibration=cal)
    assert all(len(r.prompt.split()) == 50 and r.prompt_len == 104 for r in w)  # 4 + 2 * 50


def test_shared_prefix_workload_structure() -> None:
    groups, n, prefix_len, suffix_len = 4, 40, 30, 10
    w = workload.generate_workload(
        "shared-prefix", num_prompts=n, seed=7, num_prefix_groups=groups, prefix_len=prefix_len,
        suffix_len=suffix_len, output_len=16, range_ratio=0.3,
    )
    assert w == workload.generate_workload(
        "shared-prefix", num_prompts=n, seed=7, num_prefix_groups=groups, prefix_len=prefix_len,
        suffix_len=suffix_len, output_len=16, range_ratio=0.3,
    )
    assert Counter(r.group for r in w) == {g: n // groups for g in range(groups)}  # balanced
    assert [r.group for r in w] != [i % groups for i in range(n)]  # shuffled
    prefixes: dict[int, list[str]] = {}
    for r in w:
        words = r.prompt.split()
        prefix, suffix = words[:prefix_len], words[prefix_len:]
        assert prefixes.setdefault(r.group, prefix) == prefix  # one prefix per group
        assert 7 <= len(suffix) <= 13 and r.prompt_len == prefix_len + len(suffix)
        assert r.prefix_len == prefix_len
    assert len({p[0] for p in prefixes.values()}) == groups  # prefixes differ from the first word
    # requests of a group differ after the prefix
    for g in range(groups):
        suffixes = [r.prompt.split()[prefix_len:] for r in w if r.group == g]
        assert len({tuple(s) for s in suffixes}) == len(suffixes)


def test_workload_errors() -> None:
    with pytest.raises(ValueError, match="unknown dataset"):
        workload.generate_workload("sharegpt", num_prompts=1)
    with pytest.raises(ValueError, match="range_ratio"):
        workload.generate_workload("random", num_prompts=1, range_ratio=1.0)
    with pytest.raises(ValueError):
        workload.generate_workload("shared-prefix", num_prompts=1, num_prefix_groups=0)


def test_request_body() -> None:
    r = workload.BenchRequest(0, "hello world", 2, 7)
    body = stream.request_body(r, "m", "completions")
    assert body == {
        "model": "m", "stream": True, "stream_options": {"include_usage": True}, "prompt": "hello world",
        "max_tokens": 7, "ignore_eos": True, "temperature": 0.0,
    }
    chat = stream.request_body(r, "m", "chat", temperature=None, extra_body={"top_k": 5})
    assert chat["messages"] == [{"role": "user", "content": "hello world"}]
    assert chat["max_completion_tokens"] == 7 and chat["top_k"] == 5 and "temperature" not in chat
    assert stream.completions_url("http://h:1/", "chat") == "http://h:1/v1/chat/completions"
    assert stream.completions_url("http://h:1/app/v1", "completions") == "http://h:1/app/v1/completions"


# -- a fake OpenAI server --------------------------------------------------------------------
class FakeOpenAI:
    """Streams `max_tokens` tokens per request like an OpenAI server with
    stream_options.include_usage: the first content chunk carries TWO tokens (so chunks
    != tokens; the count must come from usage), then one token per chunk, a finish chunk
    without text, the usage chunk, [DONE]. Prompt tokens = 2 per word + 1 (BOS).
    Requests number `reject` (in arrival order) get a 429; numbers in `stream_error` fail
    after the first token with an error event, as kvserve's ingress does."""

    MODEL = "fake-model"

    def __init__(
        self, first_token_s: float = 0.03, token_s: float = 0.002, reject: frozenset[int] = frozenset(),
        stream_error: frozenset[int] = frozenset(), api_key: str | None = None,
    ) -> None:
        self.first_token_s = first_token_s
        self.token_s = token_s
        self.reject = reject
        self.stream_error = stream_error
        self.api_key = api_key
        self.bodies: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.in_flight = self.peak_in_flight = 0
        self.app = Starlette(routes=[
            Route("/v1/models", self.models),
            Route("/v1/completions", self.generate, methods=["POST"]),
            Route("/v1/chat/completions", self.generate, methods=["POST"]),
        ])

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": self.MODEL, "object": "model", "max_model_len": 4096}]})

    async def generate(self, request: Request) -> Any:
        number = len(self.bodies)
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("authorization"))
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            return JSONResponse({"error": {"message": "bad key", "type": "invalid_request_error", "code": "invalid_api_key"}}, 401)
        if number in self.reject:
            error = {"message": "The server is at its limit; retry later.", "type": "rate_limit_error", "code": "server_overloaded"}
            return JSONResponse({"error": error}, 429)
        chat = "messages" in body
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        prompt_tokens = 2 * len(text.split()) + 1
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens, "total_tokens": prompt_tokens + max_tokens}
        if not body.get("stream"):
            return JSONResponse({"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": " w", "finish_reason": "length"}], "usage": usage})

        def chunk(text: str | None, finish: str | None = None) -> str:
            if chat:
                delta = {"content": text} if text is not None else {}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return "data: " + json.dumps({"id": "x", "object": "chunk", "model": self.MODEL, "choices": [choice]}) + "\n\n"

        async def events() -> AsyncIterator[str]:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            try:
                if chat:  # the role comes first, with empty content: not a token
                    yield "data: " + json.dumps({"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}) + "\n\n"
                await asyncio.sleep(self.first_token_s)
                yield chunk(" a b" if max_tokens >= 2 else " a")
                if number in self.stream_error:
                    yield 'data: {"error": {"message": "The request failed: RuntimeError.", "type": "server_error", "param": null, "code": "internal_error"}}\n\n'
                    yield "data: [DONE]\n\n"
                    return
                for i in range(max_tokens - 2):
                    await asyncio.sleep(self.token_s)
                    yield chunk(f" t{i}")
                yield chunk(None if chat else "", finish="length")
                yield "data: " + json.dumps({"id": "x", "choices": [], "usage": usage}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                self.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")


@contextlib.asynccontextmanager
async def serving(fake: FakeOpenAI) -> AsyncIterator[str]:
    """Runs the fake on 127.0.0.1 in this event loop. The socket listens before uvicorn
    starts, so connections made at once queue in the backlog (no start-up polling)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    config = uvicorn.Config(fake.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()


# -- end to end ---------------------------------------------------------------------------
async def test_run_against_fake_server_counts_usage_and_429s() -> None:
    fake = FakeOpenAI(first_token_s=0.05, token_s=0.002, reject=frozenset({1, 4}), api_key="sk-test")
    requests = workload.generate_workload("random", num_prompts=8, seed=0, input_len=20, output_len=6)
    async with serving(fake) as url:
        result = await run.run_benchmark(requests, base_url=url, model=fake.MODEL, api_key="sk-test", request_rate=math.inf)
    assert len(result.requests) == 8 and [r.index for r in result.requests] == list(range(8))
    ok = [r for r in result.requests if r.success]
    failed = [r for r in result.requests if not r.success]
    assert len(ok) == 6 and len(failed) == 2
    for r in failed:
        assert r.error == "HTTP 429" and r.status == 429
        assert r.error_detail == "server_overloaded: The server is at its limit; retry later."
    for r in ok:
        assert r.output_tokens == 6  # from usage: 5 content chunks carried 6 tokens
        assert r.num_chunks == 5 and len(r.itl_s) == 4
        assert r.prompt_tokens == 41  # 20 words -> 2 * 20 + 1 by the fake's tokenizer
        assert r.ttft_s is not None and r.ttft_s >= 0.04  # the fake waits 50 ms for the first token
        assert r.e2e_s is not None and r.e2e_s >= r.ttft_s + sum(r.itl_s) - 1e-9
        assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 5)
        assert not r.usage_missing
    assert all(b["stream"] and b["ignore_eos"] is True and b["stream_options"] == {"include_usage": True} for b in fake.bodies)
    assert all(b["max_tokens"] == 6 and b["model"] == fake.MODEL for b in fake.bodies)
    assert fake.auth == ["Bearer sk-test"] * 8
    assert result.peak_concurrency == 8  # rate inf, no limit: all at once

    s = result.summary(slo_ttft_ms=60_000, slo_tpot_ms=60_000)
    assert s["completed"] == 6 and s["failed"] == 2 and s["errors"] == {"HTTP 429": 2}
    assert s["total_output_tokens"] == 36 and s["total_input_tokens"] == 6 * 41
    assert s["good_requests"] == 6 and s["goodput"] == pytest.approx(6 / result.duration_s)
    assert s["output_len_mismatches"] == 0
    assert s["model"] == fake.MODEL and s["request_rate"] == math.inf


async def test_chat_stream_error_and_max_concurrency() -> None:
    fake = FakeOpenAI(first_token_s=0.02, token_s=0.001, stream_error=frozenset({2}))
    requests = workload.generate_workload("shared-prefix", num_prompts=6, seed=0, num_prefix_groups=2, prefix_len=8, suffix_len=4, output_len=4)
    async with serving(fake) as url:
        result = await run.run_benchmark(requests, base_url=url + "/v1", model=fake.MODEL, endpoint="chat", max_concurrency=2)
    assert fake.peak_in_flight <= 2 and result.peak_concurrency == 2
    assert all("messages" in b and b["max_completion_tokens"] == 4 for b in fake.bodies)
    failed = [r for r in result.requests if not r.success]
    assert len(failed) == 1
    assert failed[0].error == "stream error (internal_error)" and failed[0].status == 200
    assert failed[0].error_detail == "The request failed: RuntimeError."
    for r in result.requests:
        if r.success:
            # the role chunk (empty content) is not the first token
            assert r.ttft_s is not None and r.ttft_s >= 0.015
            assert r.output_tokens == 4 and r.num_chunks == 3 and len(r.itl_s) == 2
            assert r.prompt_tokens == 2 * 12 + 1


async def test_poisson_run_sends_at_the_arrival_times() -> None:
    fake = FakeOpenAI(first_token_s=0.0, token_s=0.0)
    requests = workload.generate_workload("random", num_prompts=5, input_len=4, output_len=2)
    rate, seed = 20.0, 5
    async with serving(fake) as url:
        result = await run.run_benchmark(requests, base_url=url, model=fake.MODEL, request_rate=rate, seed=seed)
    planned = draws.arrival_times(5, rate, seed)
    assert all(r.success for r in result.requests)
    for r, at in zip(result.requests, planned):
        assert r.start_s >= at - 0.005  # never early (the loop's clock granularity aside)
    assert result.duration_s >= planned[-1]


async def test_connection_refused_is_a_failure_with_a_reason() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        requests = workload.generate_workload("random", num_prompts=2, input_len=4, output_len=2)
        result = await run.run_benchmark(requests, base_url=f"http://127.0.0.1:{port}", model="m")
    assert [r.error for r in result.requests] == ["ConnectError", "ConnectError"]
    assert report.summarize(result.requests, result.duration_s)["errors"] == {"ConnectError": 2}


@contextlib.asynccontextmanager
async def raw_server(reply: bytes | None) -> AsyncIterator[str]:
    """A TCP server that reads a request's head and answers `reply` as is (None: never
    answers), on a port of its own."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if reply is None:
            await asyncio.sleep(30)
        else:
            writer.write(reply)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def test_a_server_that_never_answers_is_a_read_timeout() -> None:
    request = workload.BenchRequest(index=0, prompt="a b", prompt_len=2, max_tokens=2)
    async with raw_server(None) as url:
        client = make_client(timeout_s=0.2)
        try:
            result = await stream.send_request(client, url + "/v1/completions", {"model": "m"}, request,
                                               "completions", 0.0)
        finally:
            await client.close()
    assert result.error == "ReadTimeout" and not result.success


async def test_lines_longer_than_the_readers_buffer_arrive_whole() -> None:
    long_event = b"data: {" + b"x" * 300_000 + b"}"
    body = long_event + b"\r\n\r\ndata: [DONE]\n\n"
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n" % len(body)
    async with raw_server(head + body) as url:
        client = make_client(timeout_s=5.0)
        try:
            async with client.get(url) as response:
                got = [line async for line in lines(response)]
        finally:
            await client.close()
    assert got == [long_event.decode(), "", "data: [DONE]", ""]


async def test_cli_end_to_end_with_calibration_and_json(tmp_path: Any) -> None:
    from cluster.cli import build_parser

    fake = FakeOpenAI(first_token_s=0.01, token_s=0.001, reject=frozenset({8}))
    out_file = tmp_path / "bench.json"
    async with serving(fake) as url:
        args = build_parser().parse_args([
            "bench", "serve", "--base-url", url, "--num-prompts", "6", "--input-len", "41", "--output-len", "5",
            "--slo-ttft-ms", "10000", "--slo-tpot-ms", "10000", "--json", str(out_file), "--seed", "1",
        ])
        stdout, stderr = io.StringIO(), io.StringIO()
        rc = await bench_serve.bench_serve(args, stdout=stdout, stderr=stderr)
    assert rc == 0
    # Calibration first (not streamed, one token each: the word pool in chunks, one chunk
    # twice), then the 6, of which the fake rejects one (number 8 overall).
    calibration = [b for b in fake.bodies if "stream" not in b]
    assert fake.bodies[: len(calibration)] == calibration and len(calibration) == math.ceil(len(workload.WORDS) / 68) + 1
    assert all(b["max_tokens"] == 1 for b in calibration)
    assert sorted(w for b in calibration[:-1] for w in b["prompt"].split()) == sorted(workload.WORDS)
    assert "calibrated prompts on the server: 2.00 tokens/word + 1 tokens overhead" in stderr.getvalue()
    assert "6/6 requests, 1 failed" in stderr.getvalue()  # the progress bar's last line
    text = stdout.getvalue()
    assert "Successful requests:" in text and "HTTP 429:" in text and "Goodput" in text
    doc = json.loads(out_file.read_text())  # strict JSON: inf written as a string
    s = doc["summary"]
    assert s["model"] == FakeOpenAI.MODEL and s["request_rate"] == "inf" and s["dataset"] == "random"
    assert s["completed"] == 5 and s["failed"] == 1 and s["errors"] == {"HTTP 429": 1}
    assert s["mean_prompt_tokens"] == 41.0  # (41 - 1) / 2 = 20 words -> 41 tokens: calibrated exactly
    assert s["good_requests"] == 5
    assert doc["calibration"] == {"tokens_per_word": 2.0, "overhead_tokens": 1.0}
    assert len(doc["requests"]) == 6 and "api_key" not in doc["settings"]
    assert {r["error"] for r in doc["requests"]} == {None, "HTTP 429"}


async def test_cli_without_a_server_fails_cleanly() -> None:
    from cluster.cli import build_parser

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        args = build_parser().parse_args(["bench", "serve", "--base-url", url, "--num-prompts", "1"])
        stderr = io.StringIO()
        assert await bench_serve.bench_serve(args, stdout=io.StringIO(), stderr=stderr) == 1
    assert "cannot list models" in stderr.getvalue()
