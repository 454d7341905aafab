"""One streamed request against an OpenAI-compatible HTTP API: the request body, the SSE
reader that timestamps every content chunk (TTFT, inter-token gaps), and its result."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from cluster.workload.text_prompts import BenchRequest

ENDPOINTS = ("completions", "chat")


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


def error_of(body: Any) -> tuple[str | None, str | None]:
    """(code or type, message) of an OpenAI error body, when it is one."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        return (err.get("code") or err.get("type")), err.get("message")
    return None, None


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def send_request(
    client: Any,
    url: str,
    body: dict[str, Any],
    request: BenchRequest,
    endpoint: str,
    bench_start: float,
    headers: dict[str, str] | None = None,
) -> RequestResult:
    """Streams one request over `client` (cluster/bench/client.py's make_client); never
    raises for a failed request (the result says why)."""
    from cluster.bench.client import CLIENT_ERRORS, error_name, lines  # aiohttp: not at `kvserve --help`

    result = RequestResult(index=request.index, prompt_len=request.prompt_len, max_tokens=request.max_tokens)
    sent = time.perf_counter()
    result.start_s = sent - bench_start
    reader = SseReader(result, endpoint, sent)
    try:
        async with client.post(url, json=body, headers=headers) as response:
            result.status = response.status
            if response.status != 200:
                await _read_http_error(response, result)
                return result
            # Read to the end of the body (the server closes it right after [DONE]), so that
            # the connection goes back to the pool instead of being dropped.
            async for line in lines(response):
                reader.feed(line, time.perf_counter())
    except CLIENT_ERRORS as e:
        result.error = error_name(e)
        result.error_detail = str(e) or None
        return result
    except ValueError as e:  # undecodable JSON in an event
        result.error = "bad stream"
        result.error_detail = str(e)
        return result
    return reader.settle(time.perf_counter())


async def _read_http_error(response: Any, result: RequestResult) -> None:
    """A non-200 answer: its status and the server's error, when its body holds one."""
    raw = await response.read()
    result.error = f"HTTP {response.status}"
    try:
        code, message = error_of(json.loads(raw))
    except ValueError:
        code, message = None, raw.decode(errors="replace")[:200] or None
    result.error_detail = f"{code}: {message}" if code else message


@dataclass
class SseReader:
    """One stream's SSE lines, timestamped as they arrive, into its result: content chunks
    set TTFT and the inter-token gaps, the usage chunk and [DONE] are kept for `settle`.
    Lines after [DONE] or an error event are read (the connection goes back to the pool)
    and ignored."""

    result: RequestResult
    endpoint: str
    sent: float  # perf_counter at send
    last_chunk: float | None = None
    first_any: float | None = None
    usage: dict[str, Any] | None = None
    done: bool = False
    done_at: float = 0.0
    data_lines: list[str] = field(default_factory=list)  # the event being read
    event_time: float = 0.0  # its first line's arrival

    def feed(self, line: str, now: float) -> None:
        """One line of the body; raises ValueError for an undecodable event."""
        if self.done or self.result.error:
            return
        if line.startswith("data:"):
            if not self.data_lines:
                self.event_time = now
            self.data_lines.append(line[5:].removeprefix(" "))
            # OpenAI-style servers send one line per event: handle it at once.
            try:
                self.done = self._dispatch("\n".join(self.data_lines), self.event_time)
                self.data_lines = []
            except ValueError:
                return  # a multi-line event: wait for the blank line
        elif line == "" and self.data_lines:
            self.done = self._dispatch("\n".join(self.data_lines), self.event_time)
            self.data_lines = []

    def _dispatch(self, payload: str, now: float) -> bool:
        """Handles one SSE event; True at [DONE]."""
        if payload.strip() == "[DONE]":
            self.done_at = now
            return True
        chunk = json.loads(payload)
        code, message = error_of(chunk)
        if code is not None or message is not None:
            self.result.error = f"stream error ({code or 'unknown'})"
            self.result.error_detail = message
            return False
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("choices") and self.first_any is None:
            self.first_any = now
        if _chunk_text(chunk, self.endpoint):
            if self.last_chunk is None:
                self.result.ttft_s = now - self.sent
            else:
                self.result.itl_s.append(now - self.last_chunk)
            self.last_chunk = now
            self.result.num_chunks += 1
        return False

    def settle(self, end: float) -> RequestResult:
        """The result once the body has ended at `end`: a success only after [DONE]."""
        result = self.result
        if result.error:
            return result
        if not self.done:
            result.error = "incomplete stream"
            result.error_detail = "the stream ended without [DONE]"
            return result
        result.e2e_s = self.done_at - self.sent
        if self.usage:
            result.prompt_tokens = self.usage.get("prompt_tokens")
            result.output_tokens = int(self.usage.get("completion_tokens") or 0)
            details = self.usage.get("prompt_tokens_details") or {}
            result.cached_tokens = details.get("cached_tokens")
        else:
            result.usage_missing = True
            result.output_tokens = result.num_chunks
        if result.ttft_s is None:  # no text at all (e.g. every token decoded to ""): the first chunk
            result.ttft_s = (self.first_any if self.first_any is not None else end) - self.sent
        result.success = True
        return result
