"""Commands on ``llmq.control``: drain a worker, cancel a request.

Drains are keyed by ``worker_id`` (the worker and health read them), cancels by
``request_id`` (the scheduler drops a queued request, the running worker aborts it).
Commands are idempotent: repeating one has no further effect.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from schemas.base import RequestId, ShortName, Tenant, Text, Timestamp, WireMessage, WorkerId


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


ControlMessage = Annotated[DrainWorker | CancelRequest, Field(discriminator="kind")]
