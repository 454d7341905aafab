"""User-facing errors of the OpenAI-compatible API and their HTTP status codes.

The body is OpenAI's: {"error": {"message", "type", "param", "code"}}; the official
clients turn the status into BadRequestError (400), NotFoundError (404),
RateLimitError (429), and so on.
"""
from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model", "model_not_found")


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than {limit} bytes.", "invalid_request_error", None, "request_too_large")


def overloaded(limit: int) -> APIError:
    return APIError(
        429,
        f"The server is at its limit of {limit} requests in flight; retry later.",
        "rate_limit_error",
        None,
        "server_overloaded",
    )


def timed_out(seconds: float) -> APIError:
    return APIError(504, f"The request did not finish within {seconds:g} s.", "timeout_error", None, "timeout")


def internal(message: str) -> APIError:
    return APIError(500, message, "server_error", None, "internal_error")


def from_validation_error(error: ValidationError) -> APIError:
    """The first problem, worded like OpenAI's own 400s, `param` as a dotted path."""
    item = error.errors()[0]
    param = ".".join(str(p) for p in item["loc"]) or None
    if item["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if item["type"] == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    message = item["msg"].removeprefix("Value error, ")
    if param is None:  # a check across fields
        return bad_request(message[:1].upper() + message[1:] + ".", None, "invalid_value")
    return bad_request(f"Invalid value for '{param}': {message}.", param, "invalid_value")


def validated(model: type[M], data: Any) -> M:
    """`data` validated as `model`; the first problem raised as the 400 OpenAI words it
    (from_validation_error). One rule for both front ends: HTTP bodies and gRPC messages
    (converted to the same request models) are refused with the same messages."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None
