"""An HTTP request's body as the ingress reads it: bounded in size and in time, JSON, an
object, valid Unicode, then validated into its pydantic request model. Every failure is an
APIError with the status a client can act on (400, 408, 413), raised before any work.
"""
from __future__ import annotations

import asyncio
import json
import re
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from router import errors

M = TypeVar("M", bound=BaseModel)

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


async def read_json(request: Request, limit: int, read_timeout_s: float | None = None) -> tuple[dict[str, Any], int]:
    """The body as a JSON object, and its size in bytes (APIError 400 / 408 / 413). The
    whole body must arrive within `read_timeout_s`: a client that trickles bytes would
    otherwise hold a handler (and its body buffer) for as long as it likes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise errors.body_too_large(limit)
    body = bytearray()
    try:
        async with asyncio.timeout(read_timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise errors.body_too_large(limit)
    except TimeoutError:
        raise errors.APIError(
            408, f"The request body did not arrive within {read_timeout_s:g} s.", "invalid_request_error", None, "request_timeout"
        ) from None
    try:
        data = json.loads(body)
    except RecursionError:  # nesting deeper than the parser's recursion limit
        raise errors.bad_request("The request body is nested too deeply.", None, "invalid_json") from None
    except ValueError as e:
        raise errors.bad_request(f"The request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise errors.bad_request("The request body must be a JSON object.", None, "invalid_json")
    if _SURROGATE_ESCAPE.search(body) and _has_lone_surrogate(data):
        # JSON may spell a lone UTF-16 surrogate ("\ud83d"); Python keeps it in the str,
        # and the tokenizer and the response encoder would then fail on it with a 500.
        raise errors.bad_request(
            "The request body contains a lone UTF-16 surrogate escape (such as \\ud83d without its pair); "
            "strings must be valid Unicode.", None, "invalid_json"
        )
    return data, len(body)


def _has_lone_surrogate(data: Any) -> bool:
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def parse(model: type[M], data: dict[str, Any]) -> M:
    """`data` validated into `model` (APIError 400 naming the field)."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise errors.from_validation_error(e) from None
