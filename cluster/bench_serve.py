"""`kvserve bench serve`: a load generator against a running kvserve's OpenAI HTTP API,
in the style of `vllm bench serve`.

    kvserve bench serve --num-prompts 200 --request-rate 8 --input-len 256 --output-len 64
    kvserve bench serve --dataset shared-prefix --num-prefix-groups 4 --prefix-len 512 \\
        --suffix-len 64 --max-concurrency 16 --slo-ttft-ms 500 --slo-tpot-ms 50 --json out.json

Every request streams (SSE) with `ignore_eos: true` and `max_tokens`, so each produces
exactly its output length; token counts come from the `usage` chunk the server sends with
`stream_options.include_usage` (the prompt is text, and only the server's tokenizer
knows its real length). Per request: TTFT (send -> first content chunk), ITL (gaps
between content chunks), TPOT ((e2e - TTFT) / (output tokens - 1)) and e2e latency.

The library part is importable without the CLI (benchmarks/ may reuse it):

    requests = generate_workload("random", num_prompts=100, input_len=256, output_len=64, seed=0)
    result = await run_benchmark(requests, base_url="http://127.0.0.1:8000", model="kvserve-tiny",
                                 request_rate=8.0, seed=0)
    summary = summarize(result.requests, result.duration_s, slo_ttft_ms=500, slo_tpot_ms=50)
    print(format_summary(summary))

One asyncio event loop, httpx.AsyncClient streaming, no threads.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DATASETS = ("random", "shared-prefix")
ENDPOINTS = ("completions", "chat")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)

# Short, common English words: one token each in most BPE vocabularies (a leading space
# included). A server's tokenizer may still split some; `calibrate_prompt_tokens` measures
# the real ratio and the generator corrects for it.
WORDS: tuple[str, ...] = tuple(
    """the of and to in is it you that he was for on are with as his they be at one have
    this from or had by word but what some we can out other were all there when up use your
    how said an each she which do their time if will way about many then them write would
    like so these her long make thing see him two has look more day could go come did number
    sound no most people my over know water than call first who may down side been now find
    any new work part take get place made live where after back little only round man year
    came show every good me give our under name very through just form great think say help
    low line turn cause much mean before move right boy old too same tell does set three want
    air well also play small end put home read hand port large add even land here must big
    high such follow act why ask men change went light kind off need house try us again point
    mother world near build self earth father head stand own page should country found answer
    school grow study still learn plant cover food sun four between state keep eye never last
    let thought city tree cross farm hard start might story saw far sea draw left late run
    while press close night real life few north open seem together next white children begin
    got walk example ease paper group always music those both mark often letter until mile
    river car feet care second book carry took science eat room friend began idea fish
    mountain stop once base hear horse cut sure watch color face wood main enough plain girl
    usual young ready above ever red list though feel talk bird soon body dog family direct
    pose leave song measure door product black short class wind question happen complete ship
    area half rock order fire south problem piece told knew pass since top whole king space""".split()
)


# -- workload ------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload. `prompt_len` is the length asked for (tokens); the
    server's `usage` gives the real one."""

    index: int
    prompt: str
    prompt_len: int
    max_tokens: int
    group: int | None = None  # shared-prefix: the prefix group
    prefix_len: int = 0  # shared-prefix: asked length of the shared part (tokens)


@dataclass(frozen=True)
class PromptCalibration:
    """prompt_tokens ~= overhead_tokens + tokens_per_word * words, measured on the server
    (BOS, a chat template and words the tokenizer splits all show up here)."""

    tokens_per_word: float = 1.0
    overhead_tokens: float = 0.0

    def words_for(self, tokens: float) -> int:
        return max(1, round(tokens / self.tokens_per_word))


def sample_lengths(rng: random.Random, n: int, mean_len: int, range_ratio: float, minimum: int = 1) -> list[int]:
    """Lengths uniform in [mean * (1 - r), mean * (1 + r)] (vLLM's --random-range-ratio),
    at least `minimum`."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    low = max(minimum, math.floor(mean_len * (1.0 - range_ratio)))
    high = max(low, math.ceil(mean_len * (1.0 + range_ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def random_text(rng: random.Random, num_words: int, first_word: str | None = None) -> str:
    words = [rng.choice(WORDS) for _ in range(num_words)]
    if first_word is not None and words:
        words[0] = first_word
    return " ".join(words)


def generate_workload(
    dataset: str = "random",
    *,
    num_prompts: int = 100,
    seed: int = 0,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    num_prefix_groups: int = 4,
    prefix_len: int = 512,
    suffix_len: int = 128,
    calibration: PromptCalibration = PromptCalibration(),
) -> list[BenchRequest]:
    """A seeded synthetic workload (the same arguments give the same prompts).

    - "random": prompts of ~`input_len` tokens of random words, outputs of `output_len`
      tokens; both uniform within +-`range_ratio` of the mean.
    - "shared-prefix": `num_prefix_groups` prefixes of ~`prefix_len` tokens, each request
      one of them (round-robin, then shuffled) plus its own random suffix of ~`suffix_len`
      tokens (+-range_ratio); prefixes of different groups differ from the first word on.
    The calibration's overhead (BOS, chat template) is taken off the prompt (random) or
    the prefix (shared-prefix), so `prompt_len` is what the server should count.
    """
    if num_prompts < 0:
        raise ValueError("num_prompts must be >= 0")
    rng = random.Random(f"kvserve-bench:{dataset}:{seed}")
    cal = calibration
    if dataset == "random":
        in_lens = sample_lengths(rng, num_prompts, input_len, range_ratio)
        out_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
        return [
            BenchRequest(i, random_text(rng, cal.words_for(n - cal.overhead_tokens)), n, m)
            for i, (n, m) in enumerate(zip(in_lens, out_lens))
        ]
    if dataset == "shared-prefix":
        if num_prefix_groups < 1:
            raise ValueError("num_prefix_groups must be >= 1")
        if num_prefix_groups > len(WORDS):
            raise ValueError(f"at most {len(WORDS)} prefix groups")
        first_words = rng.sample(WORDS, num_prefix_groups)  # distinct: prefixes diverge at once
        prefix_words = cal.words_for(prefix_len - cal.overhead_tokens)
        prefixes = [random_text(rng, prefix_words, first_word=w) for w in first_words]
        groups = [i % num_prefix_groups for i in range(num_prompts)]
        rng.shuffle(groups)
        suffix_lens = sample_lengths(rng, num_prompts, suffix_len, range_ratio)
        out_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
        requests = []
        for i, (g, s, m) in enumerate(zip(groups, suffix_lens, out_lens)):
            prompt = prefixes[g] + " " + random_text(rng, cal.words_for(s))
            requests.append(BenchRequest(i, prompt, prefix_len + s, m, group=g, prefix_len=prefix_len))
        return requests
    raise ValueError(f"unknown dataset {dataset!r} (one of {', '.join(DATASETS)})")


def arrival_times(num: int, request_rate: float, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Seconds from the start at which each request is sent. Poisson process at
    `request_rate` req/s (gamma gaps with shape `burstiness`; 1.0 = exponential, as in
    vLLM); `inf` sends everything at t = 0. The first request goes at t = 0."""
    if num <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num
    if request_rate <= 0:
        raise ValueError("request_rate must be > 0 (or inf)")
    if burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    rng = random.Random(f"kvserve-bench-arrivals:{seed}")
    theta = 1.0 / (request_rate * burstiness)  # mean gap = shape * scale = 1 / rate
    times, t = [0.0], 0.0
    for _ in range(num - 1):
        t += rng.gammavariate(burstiness, theta)
        times.append(t)
    return times


# -- one request ---------------------------------------------------------------------------
@dataclass
class RequestResult:
    index: int
    success: bool = False
    error: str | None = None  # a short reason: "HTTP 429", "stream error (internal_error)", "ReadTimeout"
    error_detail: str | None = None  # the server's message, when it sent one
    status: int | None = None
    prompt_len: int = 0  # asked for
    max_tokens: int = 0
    prompt_tokens: int | None = None  # from usage
    output_tokens: int = 0  # from usage (content chunks if the server sent no usage)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    num_chunks: int = 0  # content chunks
    start_s: float = 0.0  # send time, from the benchmark start
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    usage_missing: bool = False

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot_s"] = self.tpot_s
        return d


def completions_url(base_url: str, endpoint: str) -> str:
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    if endpoint == "completions":
        return base + "/completions"
    if endpoint == "chat":
        return base + "/chat/completions"
    raise ValueError(f"unknown endpoint {endpoint!r} (one of {', '.join(ENDPOINTS)})")


def request_body(
    request: BenchRequest,
    model: str,
    endpoint: str,
    *,
    temperature: float | None = 0.0,
    ignore_eos: bool = True,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
        body["max_completion_tokens"] = request.max_tokens
    else:
        body["prompt"] = request.prompt
        body["max_tokens"] = request.max_tokens
    if ignore_eos:
        body["ignore_eos"] = True
    if temperature is not None:
        body["temperature"] = temperature
    if extra_body:
        body.update(extra_body)
    return body


def _chunk_text(chunk: dict[str, Any], endpoint: str) -> str:
    parts = []
    for choice in chunk.get("choices") or ():
        if endpoint == "chat":
            delta = choice.get("delta") or {}
            parts.append(delta.get("content") or "")
            parts.append(delta.get("reasoning_content") or "")
        else:
            parts.append(choice.get("text") or "")
    return "".join(parts)


def _error_of(body: Any) -> tuple[str | None, str | None]:
    """(code or type, message) of an OpenAI error body, when it is one."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        return (err.get("code") or err.get("type")), err.get("message")
    return None, None


async def send_request(
    client: Any,
    url: str,
    body: dict[str, Any],
    request: BenchRequest,
    endpoint: str,
    bench_start: float,
    headers: dict[str, str] | None = None,
) -> RequestResult:
    """Streams one request; never raises for a failed request (the result says why)."""
    import httpx

    result = RequestResult(index=request.index, prompt_len=request.prompt_len, max_tokens=request.max_tokens)
    sent = time.perf_counter()
    result.start_s = sent - bench_start
    last_chunk: float | None = None
    first_any: float | None = None
    usage: dict[str, Any] | None = None
    done = False
    done_at = 0.0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            result.status = response.status_code
            if response.status_code != 200:
                raw = await response.aread()
                result.error = f"HTTP {response.status_code}"
                try:
                    code, message = _error_of(json.loads(raw))
                except ValueError:
                    code, message = None, raw.decode(errors="replace")[:200] or None
                result.error_detail = f"{code}: {message}" if code else message
                return result
            data_lines: list[str] = []
            event_time = 0.0

            def dispatch(payload: str, now: float) -> bool:
                """Handles one SSE event; True at [DONE]."""
                nonlocal last_chunk, first_any, usage, done_at
                if payload.strip() == "[DONE]":
                    done_at = now
                    return True
                chunk = json.loads(payload)
                code, message = _error_of(chunk)
                if code is not None or message is not None:
                    result.error = f"stream error ({code or 'unknown'})"
                    result.error_detail = message
                    return False
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("choices") and first_any is None:
                    first_any = now
                if _chunk_text(chunk, endpoint):
                    if last_chunk is None:
                        result.ttft_s = now - sent
                    else:
                        result.itl_s.append(now - last_chunk)
                    last_chunk = now
                    result.num_chunks += 1
                return False

            # Read to the end of the body (the server closes it right after [DONE]), so that
            # the connection goes back to the pool instead of being dropped.
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if done or result.error:
                    continue
                if line.startswith("data:"):
                    if not data_lines:
                        event_time = now
                    data_lines.append(line[5:].removeprefix(" "))
                    # OpenAI-style servers send one line per event: handle it at once.
                    try:
                        done = dispatch("\n".join(data_lines), event_time)
                        data_lines = []
                    except ValueError:
                        continue  # a multi-line event: wait for the blank line
                elif line == "" and data_lines:
                    done = dispatch("\n".join(data_lines), event_time)
                    data_lines = []
    except httpx.HTTPError as e:
        result.error = type(e).__name__
        result.error_detail = str(e) or None
        return result
    except ValueError as e:  # undecodable JSON in an event
        result.error = "bad stream"
        result.error_detail = str(e)
        return result
    end = time.perf_counter()
    if result.error:
        return result
    if not done:
        result.error = "incomplete stream"
        result.error_detail = "the stream ended without [DONE]"
        return result
    result.e2e_s = done_at - sent
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens")
        result.output_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens")
    else:
        result.usage_missing = True
        result.output_tokens = result.num_chunks
    if result.ttft_s is None:  # no text at all (e.g. every token decoded to ""): the first chunk
        result.ttft_s = (first_any if first_any is not None else end) - sent
    result.success = True
    return result


# -- a whole run ---------------------------------------------------------------------------
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


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def make_client(max_concurrency: int | None = None, timeout_s: float = 600.0) -> Any:
    """An httpx.AsyncClient for the benchmark: enough connections for every request in
    flight (a pool wait would count as TTFT), no proxies from the environment."""
    import httpx

    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0)),
        limits=httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency),
        trust_env=False,
    )


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
    `client`: an httpx.AsyncClient to use (default: one made and closed here)."""
    url = completions_url(base_url, endpoint)
    headers = _headers(api_key)
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
            await client.aclose()
    return BenchResult(results, duration, model, endpoint, request_rate, max_concurrency, peak)


async def fetch_models(client: Any, base_url: str, api_key: str | None = None) -> list[dict[str, Any]]:
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    response = await client.get(base + "/models", headers=_headers(api_key))
    response.raise_for_status()
    return list(response.json().get("data") or [])


async def calibrate_prompt_tokens(
    client: Any,
    base_url: str,
    model: str,
    endpoint: str = "completions",
    api_key: str | None = None,
    chunk_words: int = 68,
) -> PromptCalibration:
    """What the server's tokenizer makes of the word pool (the server has no /tokenize):
    prompt tokens of every pool word once (in chunks of `chunk_words`, one request each,
    one token out, not streamed) and of the first chunk twice. Prompts draw words
    uniformly from the pool, so the pool's mean is their expected tokens per word; the
    doubled chunk separates the per-prompt overhead (BOS, a chat template)."""
    url = completions_url(base_url, endpoint)
    headers = _headers(api_key)

    async def prompt_tokens(words: Sequence[str]) -> int:
        body = request_body(BenchRequest(-1, " ".join(words), len(words), 1), model, endpoint)
        del body["stream"], body["stream_options"]
        response = await client.post(url, json=body, headers=headers)
        if response.status_code != 200:
            try:
                code, message = _error_of(response.json())
            except ValueError:
                code, message = None, None
            raise ValueError(f"HTTP {response.status_code}" + (f" ({code}: {message})" if code or message else ""))
        return int(response.json()["usage"]["prompt_tokens"])

    chunks = [WORDS[i : i + chunk_words] for i in range(0, len(WORDS), chunk_words)]
    counts = [await prompt_tokens(chunk) for chunk in chunks]
    overhead = 2 * counts[0] - await prompt_tokens(chunks[0] + chunks[0])
    ratio = (sum(counts) - len(chunks) * overhead) / len(WORDS)
    if ratio <= 0:
        raise ValueError(f"calibration measured {counts} prompt tokens for chunks of {chunk_words} words")
    return PromptCalibration(tokens_per_word=ratio, overhead_tokens=max(0.0, float(overhead)))


# -- metrics -------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default): position (n - 1) * q / 100 in the sorted values."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _pkey(q: float) -> str:
    return f"p{q:g}".replace(".", "_")


def distribution_ms(values_s: Iterable[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, float | None]:
    """mean / std / max and the percentiles (keys "p50", "p99", "p99_9") in ms."""
    xs = [v * 1000.0 for v in values_s]
    keys = ["mean", "std", "max", *(_pkey(q) for q in percentiles)]
    if not xs:
        return {k: None for k in keys}
    mean = sum(xs) / len(xs)
    out: dict[str, float | None] = {
        "mean": mean,
        "std": math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)),
        "max": max(xs),
    }
    for q in percentiles:
        out[_pkey(q)] = percentile(xs, q)
    return out


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    *,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """Aggregate metrics of one run (plain JSON-able dict). Only successful requests count
    in tokens and latencies. Goodput: successful requests per second with TTFT <=
    slo_ttft_ms and TPOT <= slo_tpot_ms (an SLO not given is met; a one-token output has
    no TPOT and meets that SLO); None when neither SLO is given."""
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    errors = Counter(r.error or "unknown" for r in failed)
    error_examples: dict[str, str] = {}
    for r in failed:
        if r.error_detail and (r.error or "unknown") not in error_examples:
            error_examples[r.error or "unknown"] = r.error_detail
    input_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)

    good = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = 0
        for r in ok:
            ttft_ok = slo_ttft_ms is None or (r.ttft_s is not None and r.ttft_s * 1000.0 <= slo_ttft_ms)
            tpot = r.tpot_s
            tpot_ok = slo_tpot_ms is None or tpot is None or tpot * 1000.0 <= slo_tpot_ms
            good += ttft_ok and tpot_ok

    return {
        "completed": len(ok),
        "failed": len(failed),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "cached_prompt_tokens": sum(cached) if cached else None,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "good_requests": good,
        "goodput": per_s(good) if good is not None else None,
        # What the workload asked for vs what the server counted (the prompt is text).
        "mean_prompt_len_requested": (sum(r.prompt_len for r in ok) / len(ok)) if ok else None,
        "mean_prompt_tokens": (
            sum(r.prompt_tokens for r in ok if r.prompt_tokens is not None) / n
            if (n := sum(r.prompt_tokens is not None for r in ok))
            else None
        ),
        "output_len_mismatches": sum(r.output_tokens != r.max_tokens for r in ok),
        "usage_missing": sum(r.usage_missing for r in ok),
        "ttft_ms": distribution_ms((r.ttft_s for r in ok if r.ttft_s is not None), percentiles),
        "tpot_ms": distribution_ms((t for r in ok if (t := r.tpot_s) is not None), percentiles),
        "itl_ms": distribution_ms((x for r in ok for x in r.itl_s), percentiles),
        "e2e_ms": distribution_ms((r.e2e_s for r in ok if r.e2e_s is not None), percentiles),
        "errors": dict(errors.most_common()),
        "error_examples": error_examples,
    }


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_summary(summary: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """vLLM-style text table of a summarize() dict."""
    width = 50
    lines = [f" {title} ".center(width, "=")]

    def row(label: str, value: Any, digits: int = 2) -> None:
        lines.append(f"{label:<40}{_fmt(value, digits):>10}")

    def section(name: str) -> None:
        lines.append(f"{name}".center(width, "-"))

    for key, label in (("model", "Model:"), ("endpoint", "Endpoint:")):
        if key in summary:
            row(label, summary[key])
    if "request_rate" in summary:
        row("Request rate (req/s):", summary["request_rate"])
        row("Max concurrency:", summary.get("max_concurrency") or "none")
        row("Peak concurrency:", summary.get("peak_concurrency"))
    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", summary["duration_s"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    if summary.get("cached_prompt_tokens") is not None:
        row("Cached prompt tokens:", summary["cached_prompt_tokens"])
    row("Mean prompt tokens (asked / served):", f"{_fmt(summary['mean_prompt_len_requested'], 1)} / {_fmt(summary['mean_prompt_tokens'], 1)}")
    row("Request throughput (req/s):", summary["request_throughput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    if summary.get("goodput") is not None:
        slos = []
        if summary.get("slo_ttft_ms") is not None:
            slos.append(f"TTFT<={summary['slo_ttft_ms']:g}ms")
        if summary.get("slo_tpot_ms") is not None:
            slos.append(f"TPOT<={summary['slo_tpot_ms']:g}ms")
        row(f"Goodput (req/s, {' '.join(slos)}):", summary["goodput"])
        row("Requests meeting the SLOs:", summary["good_requests"])
    for key, name, label in (
        ("ttft_ms", "Time to First Token", "TTFT"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
        ("itl_ms", "Inter-token Latency", "ITL"),
        ("e2e_ms", "End-to-end Latency", "E2E"),
    ):
        section(name)
        for stat, value in summary[key].items():
            if stat == "std":
                continue
            stat_label = "Mean" if stat == "mean" else "Max" if stat == "max" else stat.upper().replace("_", ".")
            row(f"{stat_label} {label} (ms):", value)
    if summary.get("output_len_mismatches"):
        lines.append(f"warning: {summary['output_len_mismatches']} request(s) produced another number of tokens than max_tokens")
    if summary.get("usage_missing"):
        lines.append(f"warning: {summary['usage_missing']} response(s) without usage: tokens counted as chunks")
    if summary["errors"]:
        section("Errors")
        for reason, count in summary["errors"].items():
            row(f"{reason}:", count)
            example = summary.get("error_examples", {}).get(reason)
            if example:
                lines.append(f"  e.g. {example[:120]}")
    lines.append("=" * width)
    return "\n".join(lines)


# -- CLI -----------------------------------------------------------------------------------
def register(subparsers: Any) -> None:
    """`kvserve bench ...` (registered in cluster/cli.py's SUBCOMMANDS)."""
    bench = subparsers.add_parser("bench", help="benchmarks against a running kvserve")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    parser = sub.add_parser(
        "serve",
        help="load-test the OpenAI HTTP API (vllm bench serve style)",
        description="Send a seeded synthetic workload to a running kvserve's OpenAI-compatible "
        "HTTP API (streaming, ignore_eos) and report throughput, TTFT, TPOT, ITL, e2e latency and goodput.",
    )
    add_bench_serve_args(parser)
    parser.set_defaults(func=run_bench_serve)


def _rate(value: str) -> float:
    rate = float(value)
    if not rate > 0:
        raise argparse.ArgumentTypeError("must be > 0 (or inf)")
    return rate


def _json_object(value: str) -> dict[str, Any]:
    try:
        obj = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return obj


def _percentiles(value: str) -> list[float]:
    try:
        qs = [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("comma-separated numbers, e.g. 50,90,99") from None
    if not qs or any(not 0 <= q <= 100 for q in qs):
        raise argparse.ArgumentTypeError("percentiles must be in [0, 100]")
    return qs


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL, help=f"the server (default {DEFAULT_BASE_URL}; a route prefix goes here)")
    parser.add_argument("--model", help="the served model name (default: the first from /v1/models)")
    parser.add_argument("--endpoint", choices=ENDPOINTS, default="completions", help="/v1/completions or /v1/chat/completions")
    parser.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"), help="sent as a bearer token (default $KVSERVE_API_KEY)")
    parser.add_argument("--dataset", choices=DATASETS, default="random")
    parser.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    parser.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens (default 1024)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request (default 128)")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [L(1-r), L(1+r)] (default 0)")
    parser.add_argument("--num-prefix-groups", type=int, default=4, help="shared-prefix: distinct prefixes (default 4)")
    parser.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: prefix tokens (default 512)")
    parser.add_argument("--suffix-len", type=int, default=128, help="shared-prefix: per-request suffix tokens (default 128)")
    parser.add_argument("--request-rate", type=_rate, default=math.inf, help="Poisson arrivals, req/s (default inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    parser.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True, help="generate exactly max_tokens (default on)")
    parser.add_argument("--extra-body", type=_json_object, help="JSON object merged into every request body")
    parser.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the server's tokens per word first (a few 1-token requests) so that prompt lengths come out near the asked ones (default on)")
    parser.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT at most this")
    parser.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT at most this")
    parser.add_argument("--percentiles", type=_percentiles, default=list(DEFAULT_PERCENTILES), help="default 50,90,99")
    parser.add_argument("--timeout", type=float, default=600.0, help="per read/connect timeout in seconds (default 600)")
    parser.add_argument("--json", metavar="FILE", help="write the summary, settings and per-request results as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run_bench_serve(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(bench_serve(args))
    except KeyboardInterrupt:
        print("kvserve bench: interrupted", file=sys.stderr)
        return 130


async def bench_serve(args: argparse.Namespace, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    try:
        import httpx
    except ImportError:
        print("kvserve bench: needs httpx (pip install httpx)", file=err)
        return 2
    if args.max_concurrency is not None and args.max_concurrency < 1:
        print("kvserve bench: --max-concurrency must be >= 1", file=err)
        return 2

    def note(message: str) -> None:
        print(message, file=err, flush=True)

    client = make_client(args.max_concurrency, args.timeout)
    try:
        model = args.model
        max_model_len = None
        try:
            models = await fetch_models(client, args.base_url, args.api_key)
        except (httpx.HTTPError, ValueError) as e:
            if model is None:
                note(f"kvserve bench: cannot list models at {args.base_url}: {type(e).__name__}: {e}")
                return 1
            models = []
        if model is None:
            if not models:
                note(f"kvserve bench: {args.base_url} serves no model")
                return 1
            model = models[0]["id"]
        for card in models:
            if card.get("id") == model:
                max_model_len = card.get("max_model_len")

        calibration = PromptCalibration()
        if args.calibrate:
            try:
                calibration = await calibrate_prompt_tokens(client, args.base_url, model, args.endpoint, args.api_key)
                note(
                    f"kvserve bench: calibrated prompts on the server: {calibration.tokens_per_word:.2f} tokens/word"
                    f" + {calibration.overhead_tokens:.0f} tokens overhead"
                )
            except (httpx.HTTPError, ValueError, KeyError) as e:
                reason = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
                note(f"kvserve bench: calibration failed ({reason}); assuming 1 token per word")

        requests = generate_workload(
            args.dataset,
            num_prompts=args.num_prompts,
            seed=args.seed,
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=args.range_ratio,
            num_prefix_groups=args.num_prefix_groups,
            prefix_len=args.prefix_len,
            suffix_len=args.suffix_len,
            calibration=calibration,
        )
        if max_model_len and requests:
            longest = max(r.prompt_len + r.max_tokens for r in requests)
            if longest > int(max_model_len):
                note(f"kvserve bench: warning: up to {longest} tokens per request; the server's max_model_len is {max_model_len}")
        mode = f"{args.request_rate:g} req/s" + (f" (burstiness {args.burstiness:g})" if args.burstiness != 1.0 else "")
        if args.max_concurrency:
            mode += f", at most {args.max_concurrency} in flight"
        note(f"kvserve bench: {len(requests)} {args.dataset} requests to {model!r} ({args.endpoint}), {mode}")
        result = await run_benchmark(
            requests,
            base_url=args.base_url,
            model=model,
            endpoint=args.endpoint,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            burstiness=args.burstiness,
            api_key=args.api_key,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            extra_body=args.extra_body,
            progress=Progress(len(requests), stream=err, enabled=not args.no_progress),
            client=client,
        )
    finally:
        await client.aclose()

    summary = result.summary(slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, percentiles=args.percentiles)
    summary["dataset"] = args.dataset
    print(format_summary(summary), file=out, flush=True)
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("func", "api_key") and not callable(v)}
        document = {
            "summary": summary,
            "settings": settings,
            "calibration": asdict(calibration),
            "requests": [r.to_dict() for r in result.requests],
        }
        with open(args.json, "w") as f:
            json.dump(jsonable(document), f, indent=1, allow_nan=False)
            f.write("\n")
        note(f"kvserve bench: wrote {args.json}")
    return 0 if summary["completed"] else 1


def jsonable(value: Any) -> Any:
    """`value` with non-finite floats as strings ("inf"), so that the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
