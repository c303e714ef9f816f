"""What workers report about themselves and about the requests they run.

- ``WorkerHeartbeat`` (``kind="heartbeat"``, compacted topic ``llmq.heartbeats``): capacity and
  load of one worker, the scheduler's only view of the fleet. A stale heartbeat means a full
  worker (fail closed), so every heartbeat is complete, never a delta.
- Lifecycle events (topic ``llmq.events``): ``event.started``, ``event.first_token``,
  ``event.done``, ``event.failed``, ``event.aborted``, each for one ``(request_id, attempt)``.
  The scheduler releases KV reservations on the terminal ones and requeues on worker loss
  only what never reached ``first_token``; ingest releases per-tenant concurrency.
  ``event.prefilled`` ends a prefill stage (prefill and decode apart): the attempt is over
  on its worker, the request is not — the scheduler places its decode stage next.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator

from schemas.base import (
    Attempt,
    Count,
    Fraction,
    KvTransfer,
    ModelName,
    Partition,
    PositiveSeconds,
    RequestId,
    Seconds,
    ShortName,
    Tenant,
    Text,
    Timestamp,
    TokenCount,
    WireMessage,
    WorkerId,
)
from schemas.common import ErrorCode, Pool, Role
from schemas.replies import FinishReason, Usage


class WorkerHeartbeat(WireMessage):
    """Complete state of one worker, published every ``interval_s`` (key ``worker_id``)."""

    kind: Literal["heartbeat"] = Field(default="heartbeat", description="Message discriminator.")
    worker_id: WorkerId = Field(description="Stable id of the worker (its Consul service id).")
    engine: ShortName = Field(description="Engine behind the worker: sim, vllm, openai.")
    model: ModelName = Field(description="Model the worker serves.")
    model_version: ShortName | None = Field(
        default=None, description="Version (revision) of the model; null when unknown."
    )
    pool: Pool = Field(description="Lanes the worker takes: short, long or any.")
    role: Role = Field(
        default="mixed",
        description="What the worker runs: mixed (requests whole), prefill (prompts, then "
        "their KV cache is handed to a decode worker) or decode (hand-offs, and long "
        "requests whole when every prefill worker is loaded).",
    )
    partition: Partition = Field(description="Partition of llmq.assignments the worker reads.")
    kv_total_tokens: Count = Field(description="Usable KV-cache capacity in tokens.")
    kv_free_tokens: Count = Field(description="KV-cache tokens free now (engine's view).")
    kv_total_bytes: Count = Field(description="Usable KV-cache capacity in bytes.")
    kv_free_bytes: Count = Field(description="KV-cache bytes free now.")
    block_size: Annotated[int, Field(ge=1, le=1 << 16)] = Field(
        description="Tokens per KV block; reservations are rounded up to blocks."
    )
    vram_total_bytes: Count = Field(description="GPU memory of the device(s), bytes.")
    vram_used_bytes: Count = Field(description="GPU memory in use, bytes.")
    gpu_util: Fraction | None = Field(
        default=None, description="GPU utilisation in [0, 1]; null without NVML."
    )
    running: Count = Field(description="Sequences in the running batch.")
    waiting: Count = Field(description="Sequences accepted but not yet running.")
    max_num_seqs: Annotated[int, Field(ge=1, le=1 << 20)] = Field(
        description="Most sequences the engine batches at once."
    )
    draining: bool = Field(description="True once drain began: takes no new assignments.")
    tokens_per_s: Annotated[float, Field(ge=0.0)] = Field(
        description="Recent generation throughput, tokens per second."
    )
    interval_s: PositiveSeconds = Field(
        description="Heartbeat period; three missed periods make the worker stale."
    )
    started_at: Timestamp = Field(
        description="Start time of this worker process; (started_at, seq) orders heartbeats "
        "across restarts."
    )
    seq: Count = Field(description="Heartbeat counter of this process, from 0.")
    ts: Timestamp = Field(description="Time of measurement, Unix seconds.")
    renew: bool = Field(
        default=False,
        description="True while the worker's lease has lapsed (a pause, a late ack): it "
        "holds its runs' records and asks the scheduler whether its work is still its own. "
        "The scheduler answers with a LeaseAnswer on llmq.control.",
    )

    @field_validator("kv_free_tokens", "kv_free_bytes", "vram_used_bytes")
    @classmethod
    def _within_total(cls, value: int, info: ValidationInfo) -> int:
        # Fields validate in declaration order, so the matching total is already in data
        # unless it failed itself (then its own error is reported).
        total_field = {
            "kv_free_tokens": "kv_total_tokens",
            "kv_free_bytes": "kv_total_bytes",
            "vram_used_bytes": "vram_total_bytes",
        }[str(info.field_name)]
        total = info.data.get(total_field)
        if total is not None and value > total:
            raise ValueError(f"exceeds {total_field} ({total})")
        return value

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes of KV cache per token, 0 for a worker that reports no KV."""
        return self.kv_total_bytes / self.kv_total_tokens if self.kv_total_tokens else 0.0


class LifecycleEvent(WireMessage):
    """Fields every lifecycle event carries (key ``request_id``)."""

    request_id: RequestId = Field(description="Request the event is about.")
    tenant: Tenant = Field(description="Tenant of the request (for per-tenant accounting).")
    attempt: Attempt = Field(description="Attempt the event belongs to; stale ones are ignored.")
    worker_id: WorkerId = Field(
        description="Worker running the attempt; for an ending the scheduler decided (a lost "
        "worker's work, a request refused or cancelled before it ran), the scheduler's id."
    )
    ts: Timestamp = Field(description="Time of the event, Unix seconds.")


class EventStarted(LifecycleEvent):
    """The worker accepted the assignment and handed it to its engine."""

    kind: Literal["event.started"] = Field(
        default="event.started", description="Message discriminator."
    )


class EventFirstToken(LifecycleEvent):
    """The first token was streamed: from now on, worker loss ends the request."""

    kind: Literal["event.first_token"] = Field(
        default="event.first_token", description="Message discriminator."
    )
    ttft_s: Seconds = Field(description="Time to first token, from created_at.")


class EventDone(LifecycleEvent):
    """The attempt finished normally and its ``done`` reply was published."""

    kind: Literal["event.done"] = Field(default="event.done", description="Message discriminator.")
    finish_reason: FinishReason = Field(description="stop: a stop condition; length: max_tokens.")
    usage: Usage = Field(description="Tokens consumed.")


class EventFailed(LifecycleEvent):
    """The attempt failed in the engine; its ``error`` reply was published."""

    kind: Literal["event.failed"] = Field(
        default="event.failed", description="Message discriminator."
    )
    code: ErrorCode = Field(description="Error code sent to the client.")
    message: Text = Field(description="What went wrong, for operators.")
    usage: Usage | None = Field(default=None, description="Tokens consumed before the failure.")


class EventAborted(LifecycleEvent):
    """The worker stopped the attempt on purpose: cancel command or deadline."""

    kind: Literal["event.aborted"] = Field(
        default="event.aborted", description="Message discriminator."
    )
    code: ErrorCode = Field(
        default="cancelled", description="Why: cancelled, or timeout at the deadline."
    )
    usage: Usage | None = Field(default=None, description="Tokens consumed before the abort.")


class EventPrefilled(LifecycleEvent):
    """A prefill stage finished: the prompt's KV cache waits on this worker for the decode
    worker the scheduler places next (attempt + 1). Nothing was sent to the client. Ends
    the attempt on this worker, not the request."""

    kind: Literal["event.prefilled"] = Field(
        default="event.prefilled", description="Message discriminator."
    )
    kv_transfer: KvTransfer = Field(
        description="The engine's KV-transfer parameters; the decode stage's assignment "
        "carries them to the decode worker's engine."
    )
    prompt_tokens: TokenCount = Field(description="Prompt tokens the engine computed.")


EventMessage = Annotated[
    EventStarted | EventFirstToken | EventPrefilled | EventDone | EventFailed | EventAborted,
    Field(discriminator="kind"),
]
#: Events after which the attempt holds no capacity any more.
TERMINAL_EVENTS: tuple[type[LifecycleEvent], ...] = (EventDone, EventFailed, EventAborted)
