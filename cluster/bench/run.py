"""A whole benchmark run: every request of a workload sent at its arrival time (at most
`max_concurrency` in flight) over one HTTP client (cluster/bench/client.py), with an
optional progress bar.
One asyncio event loop, no threads."""
from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from cluster.bench.client import make_client
from cluster.bench.report import summarize
from cluster.bench.stream import RequestResult, auth_headers, completions_url, request_body, send_request
from cluster.workload.draws import arrival_times
from cluster.workload.text_prompts import BenchRequest


@dataclass
class BenchResult:
    requests: list[RequestResult]
    duration_s: float
    model: str
    endpoint: str
    request_rate: float
    max_concurrency: int | None
    peak_concurrency: int

    def summary(self, **kwargs: Any) -> dict[str, Any]:
        """summarize() of this run (same keyword arguments), plus the run's settings."""
        out = summarize(self.requests, self.duration_s, **kwargs)
        out.update(
            model=self.model,
            endpoint=self.endpoint,
            request_rate=self.request_rate,
            max_concurrency=self.max_concurrency,
            peak_concurrency=self.peak_concurrency,
        )
        return out


class Progress:
    """A one-line progress bar on a stream (stderr): redrawn in place on a terminal at
    most 10 times a second, otherwise a line at every 10%."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True, width: int = 30) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and total > 0
        self.width = width
        self.done = self.failed = 0
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, success: bool) -> None:
        self.done += 1
        self.failed += 0 if success else 1
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._tty:
            if self.done == self.total or now - self._last_draw >= 0.1:
                self._last_draw = now
                self.stream.write("\r" + self.line(now))
                if self.done == self.total:
                    self.stream.write("\n")
                self.stream.flush()
        else:
            decile = self.done * 10 // self.total
            if decile != self._last_decile:
                self._last_decile = decile
                self.stream.write(self.line(now) + "\n")
                self.stream.flush()

    def line(self, now: float) -> str:
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        failed = f", {self.failed} failed" if self.failed else ""
        return f"[{bar}] {self.done}/{self.total} requests{failed}, {now - self.start:.1f} s"


async def run_benchmark(
    requests: Sequence[BenchRequest],
    *,
    base_url: str,
    model: str,
    endpoint: str = "completions",
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    burstiness: float = 1.0,
    api_key: str | None = None,
    temperature: float | None = 0.0,
    ignore_eos: bool = True,
    extra_body: dict[str, Any] | None = None,
    timeout_s: float = 600.0,
    progress: bool | Progress = False,
    client: Any = None,
) -> BenchResult:
    """Sends `requests` in order, request i at `arrival_times(...)[i]` (Poisson at
    `request_rate`; inf = all at once), at most `max_concurrency` in flight (a request
    that arrives while C are in flight waits, and its TTFT starts when it is sent).
    `client`: a client from make_client to use (default: one made and closed here)."""
    url = completions_url(base_url, endpoint)
    headers = auth_headers(api_key)
    times = arrival_times(len(requests), request_rate, seed, burstiness)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = progress if isinstance(progress, Progress) else Progress(len(requests), enabled=bool(progress))
    in_flight = peak = 0
    own_client = client is None
    if own_client:
        client = make_client(max_concurrency, timeout_s)

    async def one(request: BenchRequest, start: float) -> RequestResult:
        nonlocal in_flight, peak
        body = request_body(request, model, endpoint, temperature=temperature, ignore_eos=ignore_eos, extra_body=extra_body)
        if semaphore is not None:
            await semaphore.acquire()
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            result = await send_request(client, url, body, request, endpoint, start, headers)
        finally:
            in_flight -= 1
            if semaphore is not None:
                semaphore.release()
        bar.update(result.success)
        return result

    try:
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        loop_start = loop.time()
        tasks = []
        for request, at in zip(requests, times):
            delay = loop_start + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request, start)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    finally:
        if own_client:
            await client.close()
    return BenchResult(results, duration, model, endpoint, request_rate, max_concurrency, peak)
