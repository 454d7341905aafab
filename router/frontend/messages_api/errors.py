"""Anthropic's error shape, `{"type": "error", "error": {"type", "message"}}`, for every
APIError the shared pipeline raises (auth, limits, validation, timeouts) on the Messages
endpoints: the status stays, the type is Anthropic's name for it."""
from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from router.errors import APIError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
          503: "overloaded_error", 504: "timeout_error"}


def error_body(error: APIError) -> dict[str, Any]:
    kind = _TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(error: APIError) -> JSONResponse:
    retry_after = getattr(error, "retry_after_s", None)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)
