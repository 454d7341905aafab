"""The benchmark's HTTP client: one aiohttp session for the whole run.

aiohttp parses HTTP in C. The client shares the machine with what it measures, often on
the same cores: its CPU per chunk is a cost the server's figures must not carry, and a
client that reads late stretches every TTFT and inter-token gap it records.

Failures are named as the summary's error table shows them: "ConnectError" (refused,
unreachable), "ConnectTimeout", "ReadTimeout" (no byte within the timeout), else the
exception's type ("ServerDisconnectedError", ...).
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp

# What a request to the server can raise besides a bad status (TimeoutError: a timeout
# aiohttp did not wrap in its own error).
CLIENT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, TimeoutError)


def make_client(max_concurrency: int | None = None, timeout_s: float = 600.0) -> aiohttp.ClientSession:
    """A session with a connection for every request in flight (a pool wait would count
    as TTFT), `timeout_s` per connect and per read, no proxies from the environment. Call
    it on the event loop that uses it; close it with `await client.close()`."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_concurrency or 0),  # 0: no limit
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(timeout_s, 30.0), sock_read=timeout_s),
        trust_env=False,
    )


def error_name(error: BaseException) -> str:
    if isinstance(error, aiohttp.ConnectionTimeoutError):
        return "ConnectTimeout"
    if isinstance(error, aiohttp.ClientConnectorError):
        return "ConnectError"
    if isinstance(error, (aiohttp.ServerTimeoutError, TimeoutError)):
        return "ReadTimeout"
    return type(error).__name__


async def lines(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The body's lines as they arrive (without the line ending), to its end. Split here,
    not by aiohttp's readline, which refuses lines past its buffer limit (an SSE event
    with many logprobs can be one)."""
    pending = b""
    async for data in response.content.iter_any():
        pending += data
        *complete, pending = pending.split(b"\n")
        for line in complete:
            yield line.rstrip(b"\r").decode()
    if pending:
        yield pending.rstrip(b"\r").decode()


async def get_json(client: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> Any:
    """GET `url`'s JSON body; a status other than 2xx raises aiohttp.ClientResponseError."""
    async with client.get(url, headers=headers) as response:
        response.raise_for_status()
        return await response.json(content_type=None)


async def post_json(client: aiohttp.ClientSession, url: str, body: Any,
                    headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """POST `body` as JSON: (status, raw response body)."""
    async with client.post(url, json=body, headers=headers) as response:
        return response.status, await response.read()
