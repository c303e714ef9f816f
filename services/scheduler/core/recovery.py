"""Worker loss: what happens to the requests a dead worker held.

DESIGN.md: a worker whose heartbeat went stale (or whose Consul check fails) is dead. Its
requests that streamed no token are requeued at attempt + 1 with their original priority
and ``enqueued_at`` (so they keep their place in line); those that streamed tokens end with
``worker_lost`` — the client saw partial output, so only the client may retry. Either way
the worker's reservations are released and its hold and affinity entries forgotten. A
lost prefill or decode stage is requeued as the whole request (its prompt's KV is gone).

A worker that restarted (a heartbeat from a newer process on the same id) is alive, but the
work placed on its earlier process is as lost as a dead worker's: the new process drops
those assignments (``Assignment.worker_started_at``). Only that work gets the fates above.

A worker whose lease lapsed (paused, or cut off from the broker, for a little less than
the staleness bound: ``services.worker.core.lease``) asks whether its work is still its
own: :func:`lease_refusal` says no once any of that incarnation's work was declared lost,
or once a newer process of the worker is known; otherwise the answer is yes, and the
asking heartbeat, being fresh, keeps the worker alive.
"""

from __future__ import annotations

from collections.abc import Collection

from schemas.common import MAX_ATTEMPT
from services.scheduler.core.ledger import Ledger
from services.scheduler.core.types import Reject, Requeue, ReservationKey


def requeue_lost(
    ledger: Ledger,
    worker_id: str,
    streamed: Collection[str],
    only: Collection[ReservationKey] | None = None,
) -> list[Requeue | Reject]:
    """Release ``worker_id``'s reservations and decide each request's fate.

    ``streamed`` holds the request ids for which at least one token reached the reply
    topic. The caller pushes each ``Requeue.request`` back with ``pending.push(request,
    force=True)`` and publishes each ``Reject`` as the request's terminal error.

    ``only``: the worker restarted rather than died — just these reservations (the work
    placed on its earlier process, which the new one will not run) are lost; the worker,
    its hold and its affinity entries stay.
    """
    if only is None:
        lost, cause = ledger.drop_worker(worker_id), "lost"
    else:
        lost, cause = ledger.drop(only), "restarted"
    decisions: list[Requeue | Reject] = []
    for reservation in lost:
        request = reservation.request
        if request.request_id in streamed:
            decisions.append(
                Reject(request.request_id, "worker_lost", f"{worker_id} {cause} mid-stream")
            )
        elif request.attempt >= MAX_ATTEMPT:  # no attempt is left to place it at
            decisions.append(Reject(request.request_id, "worker_lost",
                                    f"{worker_id} {cause} at attempt {request.attempt}, "
                                    f"the last one ({MAX_ATTEMPT})"))
        else:
            decisions.append(
                Requeue(request.as_whole(request.attempt + 1), f"{worker_id} {cause}")
            )
    return decisions


def lease_refusal(asking: float, lost: Collection[float], newest: float | None) -> str:
    """Why the incarnation ``asking`` (its ``started_at``) may not renew its lease: ``""``
    when it may. ``lost``: the incarnations of this worker whose work was declared lost;
    ``newest``: the newest ``started_at`` heard from the worker (None: none)."""
    if asking in lost:
        return "its work was declared lost (stale heartbeat) and requeued or ended"
    if newest is not None and newest > asking:
        return "a newer process of this worker is running"
    return ""
