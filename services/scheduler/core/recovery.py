"""Worker loss: what happens to the requests a dead worker held.

DESIGN.md: a worker whose heartbeat went stale (or whose Consul check fails) is dead. Its
requests that streamed no token are requeued at attempt + 1 with their original priority
and ``enqueued_at`` (so they keep their place in line); those that streamed tokens end with
``worker_lost`` — the client saw partial output, so only the client may retry. Either way
the worker's reservations are released and its hold and affinity entries forgotten.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

from services.scheduler.core.ledger import Ledger
from services.scheduler.core.types import Reject, Requeue


def requeue_lost(
    ledger: Ledger, worker_id: str, streamed: Collection[str]
) -> list[Requeue | Reject]:
    """Release ``worker_id``'s reservations and decide each request's fate.

    ``streamed`` holds the request ids for which at least one token reached the reply
    topic. The caller pushes each ``Requeue.request`` back with ``pending.push(request,
    force=True)`` and publishes each ``Reject`` as the request's terminal error.
    """
    decisions: list[Requeue | Reject] = []
    for reservation in ledger.drop_worker(worker_id):
        request = reservation.request
        if request.request_id in streamed:
            decisions.append(
                Reject(request.request_id, "worker_lost", f"{worker_id} lost mid-stream")
            )
        else:
            decisions.append(
                Requeue(replace(request, attempt=request.attempt + 1), f"{worker_id} lost")
            )
    return decisions
