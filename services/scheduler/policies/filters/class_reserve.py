"""Filter ``class-reserve``: the last sequence slots and KV of a worker are for the high class.

Formula: a request of the ``high`` class — its own, or the one it has aged into
(``ctx.class_rank``: the pending queue's aging) — is always accepted, and so is any
request on a worker with nothing in flight (a reserve must not idle a worker, nor starve a
request too big for the rest). Any other is accepted ⇔ the worker keeps, after it,
``kept`` sequence slots and ``kv_fraction`` of its usable KV free:
``in_flight + 1 + kept ≤ max_num_seqs`` with ``kept = min(seqs, ⌊max_num_seqs / 4⌋)``, and
``request.kv_tokens + ⌊kv_fraction × ledger.usable_kv(worker)⌋ ≤ ledger.free_kv(worker)``.

Why: a high-priority request that arrives at a full fleet waits for the next finish on its
route (≈ 100 ms at 85 % load on eight workers). Keeping a little room that only the high
class may take lets it start at once, at the cost of that room for the others; with the
default 10 % high share the reserve is mostly in use anyway. Aging still applies: a low
request promoted to the high class by waiting may take the reserve too.

Reads: the ledger's in-flight count, free and usable KV; ``worker.max_num_seqs``;
the request's aged class. Stage ``room`` (asked per batch of candidates; a high-class
request is accepted without a look at the workers).

Config (optional; defaults shown)::

    filters = [..., "class-reserve"]
    [params.class-reserve]
    seqs = 8            # sequence slots kept per worker, >= 0
    kv_fraction = 0.02  # share of the usable KV kept, in [0, 0.5]
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.core.errors import ConfigError
from services.scheduler.core.ledger import Ledger
from services.scheduler.core.types import QueuedRequest, WorkerState
from services.scheduler.policies.base import Params, PlacementContext, Stage
from services.scheduler.policies.params import number, only

DEFAULT_SEQS = 8
DEFAULT_KV_FRACTION = 0.02


class ClassReserve:
    name = "class-reserve"
    stage: Stage = "room"

    def __init__(self, seqs: int = DEFAULT_SEQS, kv_fraction: float = DEFAULT_KV_FRACTION) -> None:
        self.seqs = seqs
        self.kv_fraction = kv_fraction

    def accepts(self, worker: WorkerState, request: QueuedRequest, ctx: PlacementContext) -> bool:
        if ctx.class_rank(request) == 0:  # high, or aged into it
            return True
        return self._keeps_reserve(worker, request.kv_tokens, ctx.ledger)

    def accepts_each(
        self, workers: Sequence[WorkerState], request: QueuedRequest, ctx: PlacementContext
    ) -> list[bool]:
        if ctx.class_rank(request) == 0:  # high, or aged into it: the class is asked once
            return [True] * len(workers)
        kv_tokens, ledger = request.kv_tokens, ctx.ledger
        return [self._keeps_reserve(w, kv_tokens, ledger) for w in workers]

    def _keeps_reserve(self, worker: WorkerState, kv_tokens: int, ledger: Ledger) -> bool:
        """True when a request of ``kv_tokens`` below the high class leaves the reserve."""
        in_flight = ledger.in_flight(worker)
        if in_flight == 0:
            return True
        kept = min(self.seqs, worker.max_num_seqs // 4)
        if in_flight + 1 + kept > worker.max_num_seqs:
            return False
        kept = int(self.kv_fraction * ledger.usable_kv(worker))
        return kv_tokens + kept <= ledger.free_kv(worker)


def factory(params: Params) -> ClassReserve:
    only(params, ClassReserve.name, ("seqs", "kv_fraction"))
    seqs = number(params, ClassReserve.name, "seqs", DEFAULT_SEQS, low=0, high=1 << 20)
    if seqs != int(seqs):
        raise ConfigError(f"params.{ClassReserve.name}.seqs", f"must be an integer, got {seqs!r}")
    kv_fraction = number(
        params, ClassReserve.name, "kv_fraction", DEFAULT_KV_FRACTION, low=0.0, high=0.5
    )
    return ClassReserve(int(seqs), kv_fraction)
