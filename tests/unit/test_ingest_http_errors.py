"""Terminal errors → HTTP: status per code, OpenAI's error body, Retry-After rounding."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import get_args

import pytest

from schemas.codec import FieldError, SchemaError
from schemas.common import HTTP_STATUS, ErrorCode
from schemas.replies import Error
from services.ingest.http.errors import (
    ApiError,
    from_reply,
    from_schema_error,
    retry_after_header,
    unauthorized,
)


def _error(code: ErrorCode, retry_after_s: float | None = None) -> Error:
    return Error(request_id="r1", attempt=0, code=code, message=f"because {code}",
                 retry_after_s=retry_after_s, ts=1.0)


@pytest.mark.parametrize(
    ("code", "status"),
    [("rate_limited", 429), ("too_large", 413), ("unknown_model", 404), ("invalid", 400),
     ("queue_timeout", 504), ("timeout", 504), ("worker_lost", 503), ("cancelled", 499),
     ("overloaded", 503)],
)
def test_status_per_code(code: ErrorCode, status: int) -> None:
    api = from_reply(_error(code))
    assert api.status == status
    assert api.body() == {"error": {"message": f"because {code}", "type": api.type,
                                    "param": None, "code": code}}


def test_every_code_has_a_status() -> None:
    assert set(get_args(ErrorCode)) == set(HTTP_STATUS)


@pytest.mark.parametrize(
    ("seconds", "header"),
    [(0.0, "1"), (1e-11, "1"), (0.2, "1"), (1.0, "1"), (1.0000000001, "1"), (1.5, "2"),
     (59.999, "60"), (60.0, "60"), (300.25, "301")],
)
def test_retry_after_rounds_up_to_whole_seconds_at_least_one(seconds: float, header: str) -> None:
    assert retry_after_header(seconds) == header


def test_response_carries_retry_after_only_when_given() -> None:
    limited = from_reply(_error("rate_limited", retry_after_s=2.1)).response()
    assert limited.status_code == 429 and limited.headers["retry-after"] == "3"
    assert json.loads(limited.body)["error"]["type"] == "rate_limit_error"
    assert "retry-after" not in from_reply(_error("too_large")).response().headers


def test_schema_errors_become_400_or_413() -> None:
    bad = SchemaError((FieldError("max_tokens", "greater_than_equal", "must be >= 1"),))
    api = from_schema_error(bad, "max_tokens")
    assert (api.status, api.param, api.code) == (400, "max_tokens", "invalid")
    assert api.message == "max_tokens: must be >= 1"
    big = SchemaError((FieldError("prompt", "string_too_long", "too long"),))
    assert from_schema_error(big, "prompt").status == 413


def test_unauthorized_shape() -> None:
    api = unauthorized("invalid API key")
    assert api.status == 401 and api.body()["error"]["code"] == "invalid_api_key"
    assert isinstance(api, Exception) and "invalid API key" in str(api)


@contextlib.contextmanager
def _passing_through() -> Iterator[None]:
    yield


@contextlib.asynccontextmanager
async def _passing_through_async() -> AsyncIterator[None]:
    yield


def test_api_error_can_be_raised_through_context_managers() -> None:
    # contextlib's __exit__ assigns exc.__traceback__ in Python; a frozen ApiError would turn
    # every refusal raised inside a `with` into FrozenInstanceError.
    with pytest.raises(ApiError) as raised, _passing_through():
        raise ApiError(400, "x")
    assert raised.value.status == 400 and raised.value.message == "x"


async def test_api_error_can_be_raised_through_async_context_managers() -> None:
    with pytest.raises(ApiError) as raised:
        async with _passing_through_async():
            raise ApiError(429, "slow down", code="rate_limited")
    assert raised.value.code == "rate_limited"


@pytest.mark.parametrize(("code", "status"),
                         [("worker_lost", 503), ("overloaded", 503), ("rate_limited", 429)])
def test_a_retryable_error_without_retry_after_gets_one(code: ErrorCode, status: int) -> None:
    # A worker's engine server that refused (429/503) sends no retry_after_s.
    response = from_reply(_error(code)).response()
    assert response.status_code == status and response.headers["retry-after"] == "1"
