"""Filter ``seq-slots``: the worker has a free sequence slot.

Formula: accept ⇔ ``in_flight < worker.max_num_seqs`` with ``in_flight = max(running +
waiting, reservations started) + reservations placed but not yet started`` — the engine's
own count plus what the ledger knows is on its way. Counting the engine's waiting queue
fails closed: a worker that already queues requests internally has no slot to offer.

Reads: ``worker.running``, ``worker.waiting``, ``worker.max_num_seqs``; the ledger's
reservations on the worker. Stage ``index`` (enforced by the candidate index together with
``kv-fits``).

Config (required, no parameters)::

    filters = [..., "seq-slots"]
"""

from __future__ import annotations

from services.scheduler.core.types import QueuedRequest, WorkerState
from services.scheduler.policies.base import Params, PlacementContext, Stage
from services.scheduler.policies.params import only


class SeqSlots:
    name = "seq-slots"
    stage: Stage = "index"  # enforced by the candidate index, see policies.base

    def accepts(self, worker: WorkerState, request: QueuedRequest, ctx: PlacementContext) -> bool:
        return ctx.ledger.in_flight(worker) < worker.max_num_seqs


def factory(params: Params) -> SeqSlots:
    only(params, SeqSlots.name)
    return SeqSlots()
