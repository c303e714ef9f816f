"""Filter ``kv-fits``: the request's KV reservation fits the worker's free KV.

Formula: accept ⇔ ``request.kv_tokens ≤ ledger.free_kv(worker)`` where ``free_kv = min(
usable − Σ reservations, kv_free − safety margin − KV reserved but not yet started)`` and
``usable = ⌊kv_total × (1 − kv_safety_margin)⌋`` (see :mod:`services.scheduler.core.ledger`
for why the minimum of the two views).

Reads: the ledger's reservations on the worker; ``worker.kv_total_tokens`` and
``worker.kv_free_tokens``. Stage ``index``: the candidate index only yields workers whose
room (free KV, given a sequence slot) covers the request, which is this rule and
``seq-slots`` together.

Config (required, no parameters; the margin is the ledger's ``kv_safety_margin``)::

    filters = [..., "kv-fits", ...]
"""

from __future__ import annotations

from services.scheduler.core.types import QueuedRequest, WorkerState
from services.scheduler.policies.base import Params, PlacementContext, Stage
from services.scheduler.policies.params import only


class KvFits:
    name = "kv-fits"
    stage: Stage = "index"  # enforced by the candidate index, see policies.base

    def accepts(self, worker: WorkerState, request: QueuedRequest, ctx: PlacementContext) -> bool:
        return request.kv_tokens <= ctx.ledger.free_kv(worker)


def factory(params: Params) -> KvFits:
    only(params, KvFits.name)
    return KvFits()
