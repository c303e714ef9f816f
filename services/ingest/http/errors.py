"""Errors as OpenAI clients expect them: status, ``{"error": {...}}`` body, Retry-After.

Every refusal of the API goes through :class:`ApiError`: terminal ``Error`` replies (status
from ``schemas.common.HTTP_STATUS``), validation failures (400/413 naming the field),
authentication (401). ``Retry-After`` is the reply's ``retry_after_s`` rounded up to whole
seconds (RFC 9110 allows only integers); a retryable reply without one (``worker_lost``,
``overloaded``, ``rate_limited``) gets a default, any other omits it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

from fastapi.responses import JSONResponse

from schemas.codec import SchemaError, is_input_field
from schemas.common import ErrorCode
from schemas.replies import Error

#: OpenAI's ``error.type`` per status (clients branch on the status; this is for humans).
_TYPES: Final[dict[int, str]] = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    503: "service_unavailable",
    504: "timeout",
}


# Not frozen: exceptions get __traceback__ and friends assigned as they propagate.
@dataclass(eq=False)
class ApiError(Exception):
    """One HTTP refusal; :meth:`response` renders it."""

    status: int
    message: str
    code: str | None = None
    param: str | None = None
    retry_after_s: float | None = None

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "api_error")

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        if self.code == "duplicate_request":
            # The OpenAI SDKs retry a 409 unless told not to; the same id is refused again.
            return {"x-should-retry": "false"}
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": retry_after_header(self.retry_after_s)}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(
            self.body(), status_code=self.status, headers={**self.headers(), **(headers or {})}
        )


def retry_after_header(seconds: float) -> str:
    """Whole seconds, rounded up, at least 1 (a refusal that asks for a wait must not invite
    an immediate retry: the figures behind it refresh about once a second); float noise
    below a microsecond does not add a second."""
    return str(max(1, math.ceil(round(seconds, 6))))


#: Retry-After for a retryable ``Error`` that carries none: a worker lost (503: the fleet
#: has others, the scheduler requeues what had not started), or a worker's engine server
#: that refused it (``overloaded`` 503 or ``rate_limited`` 429: one engine's queue, not the
#: fleet's, which admission already measured). One second: the shortest Retry-After a
#: header can say, and about how often the figures behind a refusal refresh.
DEFAULT_RETRY_AFTER_S: Final[dict[ErrorCode, float]] = {
    "worker_lost": 1.0, "overloaded": 1.0, "rate_limited": 1.0,
}


def from_reply(error: Error) -> ApiError:
    """The HTTP refusal for a terminal ``Error`` reply; a retryable one always has a
    Retry-After (:data:`DEFAULT_RETRY_AFTER_S` when the reply has none)."""
    retry = error.retry_after_s
    if retry is None:
        retry = DEFAULT_RETRY_AFTER_S.get(error.code)
    return ApiError(error.http_status, error.message, error.code, retry_after_s=retry)


def from_schema_error(exc: SchemaError, param: str | None) -> ApiError:
    """400 naming ``param``, the field as the client spelled it; 413 when it is the input
    (the prompt, the messages or one's content) that is over llmq's bound. An over-long
    short field (a 300-character ``stop`` or ``model``, too many stop strings, a long
    ``x-request-id``) is a malformed request, not a payload too large."""
    first = exc.errors[0]
    where = f"{param}: " if param else ""
    if exc.error_code == "too_large" and _is_input(param):
        return ApiError(413, f"{where}{first.message}", "too_large", param)
    return ApiError(400, f"{where}{first.message}", "invalid", param)


def _is_input(param: str | None) -> bool:
    return param is None or is_input_field(param)  # None: the record as a whole


def invalid(message: str, param: str | None = None) -> ApiError:
    """400 for a request the API does not accept."""
    return ApiError(400, message, "invalid", param)


def too_large(message: str, param: str | None = None) -> ApiError:
    """413 for input larger than llmq carries."""
    return ApiError(413, message, "too_large", param)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, "invalid_api_key")


def unavailable(message: str, retry_after_s: float | None = 1.0) -> ApiError:
    return ApiError(503, message, "overloaded", retry_after_s=retry_after_s)


def timed_out(message: str) -> ApiError:
    return ApiError(504, message, "timeout")
