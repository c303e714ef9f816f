"""Commands on ``llmq.control``: drain a worker, cancel a request, answer a lease renewal.

Drains are keyed by ``worker_id`` (the worker and health read them), cancels by
``request_id`` (the scheduler drops a queued request, the running worker aborts it), lease
answers by ``worker_id`` (the scheduler's answer to a heartbeat with ``renew``; only that
worker acts on it). Commands are idempotent: repeating one has no further effect.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from schemas.base import (
    Count,
    RequestId,
    ShortName,
    Tenant,
    Text,
    Timestamp,
    WireMessage,
    WorkerId,
)


class DrainWorker(WireMessage):
    """Stop taking assignments, finish in-flight work, deregister, exit 0."""

    kind: Literal["drain"] = Field(default="drain", description="Message discriminator.")
    worker_id: WorkerId = Field(description="Worker to drain.")
    reason: Text = Field(default="", description="Why, for operators.")
    issued_by: ShortName = Field(description="Who asked: cli, health, an operator name.")
    issued_at: Timestamp = Field(description="Time of the command, Unix seconds.")


class CancelRequest(WireMessage):
    """End a request with ``cancelled`` wherever it is (queued or running)."""

    kind: Literal["cancel"] = Field(default="cancel", description="Message discriminator.")
    request_id: RequestId = Field(description="Request to cancel.")
    tenant: Tenant = Field(description="Tenant that owns it; a mismatch is ignored.")
    reason: Text = Field(default="", description="Why: client disconnect, operator, ...")
    issued_by: ShortName = Field(description="Who asked: ingest, cli, an operator name.")
    issued_at: Timestamp = Field(description="Time of the command, Unix seconds.")


class LeaseAnswer(WireMessage):
    """The scheduler's answer to a heartbeat that asked to renew a lapsed lease.

    ``granted``: the scheduler had not declared that incarnation of the worker dead, and now
    that it has read the heartbeat it will not for the gap: the worker may answer its work
    again. Not granted: its work was requeued or ended meanwhile (or a newer process holds
    the worker id), so the worker must end it unanswered and go on as a new incarnation.
    """

    kind: Literal["lease"] = Field(default="lease", description="Message discriminator.")
    worker_id: WorkerId = Field(description="Worker whose heartbeat asked.")
    started_at: Timestamp = Field(
        description="Incarnation answered: the heartbeat's started_at."
    )
    seq: Count = Field(description="Seq of the heartbeat answered.")
    granted: bool = Field(description="True: the work is still the worker's to answer.")
    reason: Text = Field(default="", description="Why not, for operators.")
    issued_by: ShortName = Field(description="Scheduler that answered.")
    issued_at: Timestamp = Field(description="Time of the answer, Unix seconds.")


ControlMessage = Annotated[
    DrainWorker | CancelRequest | LeaseAnswer, Field(discriminator="kind")
]
