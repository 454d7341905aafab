"""router/frontend/openai_api/http_body.py read_json: the body cap, and strings that are not valid Unicode."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from router.errors import APIError
from router.frontend.openai_api.http_body import read_json


class FakeRequest:
    def __init__(self, body: bytes, declared: int | None = None) -> None:
        self._body = body
        self.headers = {} if declared is None else {"content-length": str(declared)}

    async def stream(self) -> AsyncIterator[bytes]:
        for i in range(0, len(self._body), 7):
            yield self._body[i : i + 7]


def read(body: bytes, limit: int = 1000, declared: int | None = None) -> object:
    data, num_bytes = asyncio.run(read_json(FakeRequest(body, declared), limit))  # type: ignore[arg-type]
    assert num_bytes == len(body)
    return data


def status(body: bytes, limit: int = 1000, declared: int | None = None) -> int:
    with pytest.raises(APIError) as e:
        read(body, limit, declared)
    return e.value.status


def test_valid_bodies_parse() -> None:
    assert read(b'{"prompt": "\\ud83d\\ude42 ok"}') == {"prompt": "\U0001F642 ok"}  # a proper pair


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "Hello\\ud83d"}',
        b'{"stop": ["\\udfff"]}',
        b'{"\\ud800": 1}',
        b'{"messages": [{"content": "a\\uDBFFb"}]}',
        b'{"prompt": "\\ude42\\ud83d"}',  # a pair in the wrong order
    ],
)
def test_lone_surrogates_are_400(body: bytes) -> None:
    assert status(body) == 400


@pytest.mark.parametrize("body", [b"\xff\xfe", b'{"prompt": "\xc3\x28"}', b"[1, 2]", b"", b"nul"])
def test_not_a_json_object_is_400(body: bytes) -> None:
    assert status(body) == 400


def test_body_cap_is_413() -> None:
    assert status(b"x" * 20, limit=10) == 413
    assert status(b"{}", limit=10, declared=11) == 413  # by Content-Length, before reading
    assert status(b"{" + b" " * 30 + b"}", limit=10, declared=2) == 413  # a lying Content-Length
