"""The scheduler's queue status per model (compacted topic ``llmq.status``, key = model).

Ingest needs two numbers it cannot see itself to refuse early with an honest Retry-After:
how much demand is queued for a model, and how fast the fleet drains it. The scheduler owns
the pending queue and sees every terminal event, so it publishes both, once a second.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from schemas.base import Count, ModelName, ShortName, Timestamp, WireMessage


class QueueStatus(WireMessage):
    """Queued demand and measured drain rate of one model, from one scheduler."""

    kind: Literal["queue_status"] = Field(
        default="queue_status", description="Message discriminator."
    )
    model: ModelName = Field(description="Model the figures are about.")
    scheduler_id: ShortName = Field(description="Scheduler instance that measured them.")
    pending_requests: Count = Field(description="Requests waiting in the pending queue.")
    pending_tokens: Count = Field(
        description="Σ (prompt + max_tokens) of the pending requests: the queued demand."
    )
    running_tokens: Count = Field(description="Σ reserved tokens of placed, unfinished requests.")
    drain_tokens_per_s: Annotated[float, Field(ge=0.0)] = Field(
        description="Reserved tokens (prompt + max_tokens, the unit of pending_tokens) of "
        "requests finished per second over the recent window; 0 when nothing finished yet."
    )
    live_workers: Count = Field(description="Workers with a fresh heartbeat serving the model.")
    max_usable_kv_tokens: Count = Field(
        description="Largest usable KV capacity of one live worker serving the model."
    )
    ts: Timestamp = Field(description="Time of measurement, Unix seconds.")
