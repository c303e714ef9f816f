"""What the client receives on its reply topic (``llmq.replies.{tenant}`` or an authorized
``reply_to``), keyed by ``request_id``.

Zero or more ``TokenChunk`` messages, then exactly one terminal message: ``Done`` or
``Error``. Delivery is at-least-once, so clients drop chunks whose ``(attempt, seq)`` they
have seen and anything of an attempt older than the newest one. Ingest (rejections), the
scheduler (queue timeouts, worker loss) and workers all publish here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from schemas.base import (
    MAX_CHUNK_CHARS,
    Attempt,
    Count,
    FrozenModel,
    ModelName,
    RequestId,
    Seconds,
    Text,
    Timestamp,
    TokenCount,
    WireMessage,
)
from schemas.common import HTTP_STATUS, ErrorCode

FinishReason = Literal["stop", "length"]


class Usage(FrozenModel):
    """Token accounting of one request."""

    prompt_tokens: TokenCount = Field(description="Prompt tokens as the engine counted them.")
    completion_tokens: TokenCount = Field(description="Tokens generated.")

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Timings(FrozenModel):
    """Where the time of one request went, measured from its ``created_at``."""

    queued_s: Seconds = Field(
        description="From created_at until the engine started it; for a request run in two "
        "stages (prefill and decode workers), until the decode engine did, so it includes "
        "the prefill.")
    ttft_s: Seconds | None = Field(
        default=None, description="Time to first token; null when no token was generated."
    )
    e2e_s: Seconds = Field(description="From created_at until the terminal message.")


class TokenChunk(WireMessage):
    """A piece of generated text: one or more tokens, in order."""

    kind: Literal["chunk"] = Field(default="chunk", description="Message discriminator.")
    request_id: RequestId = Field(description="Request the text belongs to.")
    attempt: Attempt = Field(description="Attempt that produced it.")
    seq: Count = Field(description="Position of the chunk within the attempt, from 0.")
    text: str = Field(max_length=MAX_CHUNK_CHARS, description="Generated text of the chunk.")
    tokens: Annotated[int, Field(ge=1, le=MAX_CHUNK_CHARS)] = Field(
        description="Tokens in this chunk."
    )
    ts: Timestamp = Field(description="Time the chunk was emitted, Unix seconds.")


class Done(WireMessage):
    """Terminal: the request finished normally."""

    kind: Literal["done"] = Field(default="done", description="Message discriminator.")
    request_id: RequestId = Field(description="Request that finished.")
    attempt: Attempt = Field(description="Attempt that finished it.")
    model: ModelName = Field(description="Model that served it.")
    finish_reason: FinishReason = Field(description="stop: a stop condition; length: max_tokens.")
    usage: Usage = Field(description="Tokens consumed.")
    timings: Timings = Field(description="Queueing and latency of the request.")
    ts: Timestamp = Field(description="Time of completion, Unix seconds.")


class Error(WireMessage):
    """Terminal: the request ended without a result. The HTTP status follows from ``code``."""

    kind: Literal["error"] = Field(default="error", description="Message discriminator.")
    request_id: RequestId = Field(description="Request that ended.")
    attempt: Annotated[int, Field(ge=0, le=1_000)] = Field(
        description="Attempt that ended; 0 when the request never reached a worker."
    )
    code: ErrorCode = Field(description="Machine-readable reason.")
    message: Text = Field(description="Human-readable reason.")
    retry_after_s: Seconds | None = Field(
        default=None, description="When to retry (rate_limited, overloaded); becomes Retry-After."
    )
    ts: Timestamp = Field(description="Time the request ended, Unix seconds.")

    @property
    def http_status(self) -> int:
        """Status ingest.http answers with (DESIGN.md, "Semantics")."""
        return HTTP_STATUS[self.code]


ReplyMessage = Annotated[TokenChunk | Done | Error, Field(discriminator="kind")]
