"""One scheduling cycle: from the pending queue to placements, deferrals and rejections.

``schedule()`` is a pure decision over a frozen :class:`Snapshot` whose outcome is applied
to the two pieces of state the caller owns and passes in: the :class:`PendingQueue`
(placed, rejected, cancelled and expired requests leave it) and the :class:`Ledger`
(placements are reserved, holds set and cleared). The returned decisions are the complete
record of what changed — adapters publish them; nothing else happens. Same inputs, same
seed → same decisions.

Order of work:

1. Drop cancelled requests (``Reject(cancelled)``) and expired ones — deadline at or
   before ``now`` — (``Reject(queue_timeout)``) before anything is placed.
2. Walk the class heads. The lanes take turns by weight (:mod:`.lanes`); within a lane the
   head with the best effective priority goes next (:mod:`.queue`). Each head is placed on
   the worker the pipeline picks among those that pass every filter.
3. A head that fits nowhere blocks its class for the rest of the cycle (strict FCFS within
   a class) and gets a ``Defer``; other classes go on (backfill). When no live worker
   could *ever* take it — model or version not served by any fresh worker, no pool for
   its lane, or larger than the usable KV of every fresh worker that takes new work — it
   is rejected (``unknown_model`` / ``too_large``); for a lane that may spill (step 5)
   the other lane's pool counts too. With no fresh worker at all the fleet
   counts as saturated, and a route served only by draining workers waits for their
   replacements: both defer.
4. Holds bound backfill. Once a blocked head has waited its class's aging bound
   (``rank · aging_s_per_class``), the cycle holds its best worker — among route members
   whose usable KV could take it, the one with the most room (free KV with a sequence
   slot), else the most free KV — and no other request is placed there until the head is
   placed (there, or anywhere else first). A held worker only drains, so the head fits
   within one service time of the longest request running there. Holds are sticky across
   cycles, follow effective priority (a head takes over the hold of one behind it, never
   of one ahead), and end when the request leaves the queue or the worker leaves the
   fleet. When a hold ends mid-cycle, heads it kept out get a second look.

5. Spill: dedicated pools lend idle capacity across lanes (the profile's ``spill`` table,
   :mod:`services.scheduler.policies.profile`). A head of lane L that fits no worker of
   its own route may be placed on a worker of the other lane's dedicated pool when no
   request of that other lane is pending for its model (so the borrowed worker's own lane
   loses nothing now; a head past its aging bound whose lane has no worker of its own
   that could ever hold it borrows regardless, and holds a worker of the pool it borrows
   from as step 4 holds its own, or it would wait on the other lane's traffic without
   bound), the head has waited ``spill[L].after_s``, and the worker holds
   fewer than ``spill[L].max_per_worker`` reservations of lane L (0: no bound). Every
   filter and hold applies there as on the head's own route; the other lane's requests
   that arrive later take the borrowed worker back as the borrowed work finishes. Static
   pools are sized on average demand; spill is what lets a burst on one lane use the other
   lane's slack instead of queueing beside idle workers.

6. Prefill and decode apart. On a fleet with ``prefill`` and ``decode`` workers (their
   heartbeat's role; every other worker is ``mixed``), a new request of a route that has
   live prefill workers and a live decode worker whose usable KV could hold it is placed
   as its *prefill stage* (``phase = "prefill"``; the KV of its prompt plus the sampled
   token, in blocks) on a prefill worker, chosen by the pipeline like any placement. When
   the prompt is computed the caller puts the *decode stage* (``request.handoff()``: the
   next attempt, the whole reservation again) back into the queue, in a class of its own
   (:mod:`.queue`), and the cycle places it on a decode worker. Exceptions: when every
   prefill worker of the route has at least ``pd_overflow_tokens`` (the profile's) prompt
   tokens placed and not computed (:meth:`Ledger.uncomputed_prompt`), a long request goes
   whole to a decode worker that has none of its own; a route with decode workers and no
   live prefill worker that could hold its prompt runs requests whole on its decode
   workers; a decode stage that no live decode worker could ever hold runs whole on a
   mixed worker. Mixed workers take requests whole as before, when the stages cannot be
   placed; spill borrows only mixed workers. A head that no mixed worker could ever run
   waits where it could: an overdue one holds a prefill worker for its prefill stage, or
   a decode worker (step 4). The stages pair by engine (``WorkerState.engine``), as a KV
   connector only talks to its own kind. A prefill stage goes only to a prefill worker of
   an engine with a live decode worker (of the route) that could hold the request; a
   decode stage goes only to a decode worker of its prefill's engine
   (``QueuedRequest.kv_engine``), and one that none of those could ever hold runs whole,
   like any decode stage no decode worker could hold.

Decisions come out in this order: rejections of cancelled and expired requests, then
placements and rejections as they are decided, then one ``Defer`` per class head still
blocked (requests behind a head wait silently).

The cycle is work-conserving apart from holds and room-stage filters (the default
``class-reserve`` keeps a little room for the high class on purpose): when it returns
(without ``max_placements``), no class head fits any worker it may use that is not held
for someone else and that its room filters accept. It stops as soon as every class is
placed out or blocked, so its cost is O(placements · K log n + (placements + classes) ·
log classes), never O(pending): the next head comes off a heap per lane (:mod:`.heads`),
not a scan of every class, which made many blocked classes cost O(classes²).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import replace
from operator import mul

from schemas.common import MAX_ATTEMPT, Lane, Role
from services.scheduler.core.heads import CycleHeads
from services.scheduler.core.index import (
    Route,
    RouteIndex,
    cached_route_index,
    capacity,
    route_index,
)
from services.scheduler.core.ledger import Ledger
from services.scheduler.core.queue import ClassKey, PendingQueue
from services.scheduler.core.types import (
    Decision,
    Defer,
    Placement,
    QueuedRequest,
    Reject,
    Snapshot,
    WorkerState,
)
from services.scheduler.policies.base import PlacementContext, Scored
from services.scheduler.policies.profile import Pipeline

#: Where a prompt's KV can go: a decode worker's (engine, model version).
Holder = tuple[str | None, str | None]


def schedule(
    snapshot: Snapshot,
    pending: PendingQueue,
    ledger: Ledger,
    pipeline: Pipeline,
    now: float,
    rng: random.Random,
    *,
    max_placements: int | None = None,
) -> list[Decision]:
    """Decide one cycle and apply it to ``pending`` and ``ledger`` (see module docstring).

    ``now`` drives deadlines, aging and holds; heartbeat staleness is judged at
    ``snapshot.now``. ``max_placements`` stops after that many placements (the rest wait
    for the next call); it does not limit rejections of cancelled or expired requests.
    """
    decisions: list[Decision] = []
    for request in pending.take_cancelled():
        ledger.unhold(request.request_id)
        decisions.append(Reject(request.request_id, "cancelled", "cancelled while queued"))
    for request in pending.expire(now):
        ledger.unhold(request.request_id)
        waited = now - request.enqueued_at
        decisions.append(
            Reject(request.request_id, "queue_timeout", f"deadline passed after {waited:.3f}s")
        )
    _drop_stale_holds(snapshot, pending, ledger)
    if max_placements is None or max_placements > 0:
        _Cycle(snapshot, pending, ledger, pipeline, now, rng, decisions).run(max_placements)
    return decisions


def _drop_stale_holds(snapshot: Snapshot, pending: PendingQueue, ledger: Ledger) -> None:
    if not ledger.hold_count():  # the usual case: skip building the view
        return
    for worker_id, request_id in list(ledger.holds().items()):
        worker = snapshot.workers.get(worker_id)
        if (
            request_id not in pending
            or worker is None
            or worker.draining
            or not snapshot.is_fresh(worker)
        ):
            ledger.unhold(request_id)


def _other(lane: Lane) -> Lane:
    return "long" if lane == "short" else "short"


def _borrowed(pool: Lane, admits: Callable[[WorkerState], bool]) -> Callable[[WorkerState], bool]:
    """Route membership for a spill: dedicated workers of ``pool`` only (``any`` workers
    are already on the request's own route)."""

    def member(worker: WorkerState) -> bool:
        return worker.pool == pool and admits(worker)

    return member


def _has_roles(snapshot: Snapshot) -> bool:
    """True when some worker of the snapshot is not ``mixed`` (memoised per snapshot)."""
    found = snapshot.memo.get("roles")
    if found is None:
        found = snapshot.memo["roles"] = any(
            w.role != "mixed" for w in snapshot.workers.values())
    return bool(found)


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size) * block_size


def _deferred_head(pending: PendingQueue, klass: ClassKey) -> tuple[float, QueuedRequest]:
    """The head of a class blocked earlier in this cycle (it cannot have left meanwhile),
    with its order key."""
    head = pending.keyed_head(klass)
    assert head is not None
    return head


class _Cycle:
    """The working state of one ``schedule()`` call; discarded when it returns."""

    __slots__ = (
        "ctx",
        "decisions",
        "hold_refused",
        "ledger",
        "loaded",
        "max_usable",
        "no_overflow",
        "now",
        "pending",
        "pipeline",
        "prompt_free",
        "refusal",
        "rng",
        "snapshot",
        "spill_bound",
        "usable_by_engine",
    )

    def __init__(
        self,
        snapshot: Snapshot,
        pending: PendingQueue,
        ledger: Ledger,
        pipeline: Pipeline,
        now: float,
        rng: random.Random,
        decisions: list[Decision],
    ) -> None:
        self.snapshot = snapshot
        self.pending = pending
        self.ledger = ledger
        self.pipeline = pipeline
        self.now = now
        self.rng = rng
        self.decisions = decisions
        self.ctx = PlacementContext(snapshot, ledger, now, pending.engine_priority)
        self.refusal = ""
        self.hold_refused = False
        self.spill_bound = 0  # > 0 while placing a spill with a per-worker bound
        self.prompt_free = False  # while placing an overflow: workers with no prompt work
        self.max_usable: dict[int, int] = {}  # per route index (by id), see _max_usable
        self.usable_by_engine: dict[int, dict[Holder, int]] = {}  # see _holding_engines
        self.loaded: set[int] = set()  # prefill indexes (by id) whose members are all loaded
        self.no_overflow: set[Route] = set()  # routes whose overflow found no worker

    def run(self, max_placements: int | None) -> None:
        pending, ledger = self.pending, self.ledger
        heads = CycleHeads(pending.keyed_heads())
        deferred: dict[ClassKey, Defer] = {}  # blocked for the rest of the cycle
        # ... at least partly because of a hold. A dict, in the order they were deferred:
        # a set of string-keyed classes would come back in an order that changes with
        # PYTHONHASHSEED, and with it which of two tied heads goes first.
        behind_holds: dict[ClassKey, None] = {}
        placed = 0
        while heads and (max_placements is None or placed < max_placements):
            klass, request, place = self._next(heads)
            self.hold_refused = False
            holds_before = ledger.hold_count()
            decision = self._decide(request)
            if isinstance(decision, Defer):
                heads.drop(klass)  # FCFS: the rest of the class waits behind its head
                deferred[klass] = decision
                if self.hold_refused:
                    behind_holds[klass] = None
                continue
            self.decisions.append(decision)
            if isinstance(decision, Placement):
                placed += 1
            if ledger.hold_count() < holds_before:
                # A hold ended mid-cycle: what it kept out may fit now.
                for other in behind_holds:
                    del deferred[other]
                    heads.put(other, *_deferred_head(pending, other))
                behind_holds.clear()
            following = pending.keyed_head(klass)
            if following is None:
                heads.drop(klass)
            else:
                heads.put(klass, *following, place=place)
        self.decisions.extend(deferred.values())

    def _next(self, heads: CycleHeads) -> tuple[ClassKey, QueuedRequest, int]:
        """The head whose turn it is: lane by weighted turns, then best effective priority
        (:mod:`.heads`); with its class and the class's place there."""
        lane = self.pending.lanes.next_lane(heads.lanes())
        assert lane is not None  # heads is non-empty
        return heads.best(lane)

    def _decide(self, request: QueuedRequest) -> Decision:
        route: Route = (request.model, request.model_version, request.lane)
        # Where the head waits (and may hold a worker) when no mixed worker could ever run
        # it: the request as it would be placed there, that index, and why it did not fit.
        own: tuple[QueuedRequest, RouteIndex] | None = None
        own_outcome = ""
        if request.phase == "decode":  # a computed prompt: decode workers (of its engine) ...
            decode = self._index(request, "decode")
            outcome = self._place(request, decode)
            if isinstance(outcome, Placement):
                return outcome
            if self._max_usable(decode) >= request.kv_tokens:
                return self._blocked(request, route, decode, outcome)
            # ... unless none could ever hold it (none live, or all too small): it runs
            # whole on a mixed worker (its prompt computed again), or waits as one would;
            # when only its engine has none, decode workers of another may run it whole.
            whole = request.as_whole(request.attempt)
            if request.kv_engine is not None:
                others = self._index(whole, "decode")
                if self._max_usable(others) >= whole.kv_tokens:
                    own = (whole, others)
            request = whole
        elif _has_roles(self.snapshot):
            decode = self._index(request, "decode")
            engines = self._holding_engines(decode, request.kv_tokens)
            prefill = self._index(request, "prefill", engines=engines) if engines else None
            # (At the last attempt, no later one is left for a decode stage: it runs whole.)
            staged = None if prefill is None or not prefill.members \
                or request.attempt >= MAX_ATTEMPT else self._prefill_stage(request, prefill)
            if staged is not None and prefill is not None \
                    and self._max_usable(prefill) >= staged.kv_tokens:
                overflow = self._overflow(request, route, prefill, decode)
                if overflow is not None:
                    return overflow
                outcome = self._place(staged, prefill)
                if isinstance(outcome, Placement):
                    return outcome
                own, own_outcome = (staged, prefill), outcome
            elif engines:  # no live prefill worker that could take its prompt: after mixed
                own = (request, decode)  # workers, decode ones take it whole
        index = self._index(request, "mixed")
        outcome = self._place(request, index)
        if isinstance(outcome, Placement):
            return outcome
        if own is not None and own[0] is request:
            placed = self._place(request, own[1])
            if isinstance(placed, Placement):
                return placed
            own_outcome = placed
        # Whether a worker of its own (mixed, or its stage's) could ever hold it.
        holds_own = self._max_usable(index) >= request.kv_tokens or (
            own is not None and self._max_usable(own[1]) >= own[0].kv_tokens)
        if self.pipeline.spill:
            spilled = self._spill(request, own_pool=holds_own)
            if spilled is not None:
                return spilled
            if not holds_own and request.lane in self.pipeline.spill:
                borrowed = self._borrow_index(request)
                if self._max_usable(borrowed) >= request.kv_tokens:
                    # Stranded (step 5): once overdue it holds a worker of the pool it
                    # borrows from, or the other lane's traffic would refill that worker's
                    # KV without bound (no hold was taken: a head waited 400 s past 62).
                    return self._blocked(request, route, borrowed, outcome)
        if own is not None and self._max_usable(index) < request.kv_tokens:
            # No mixed worker could ever run it: it waits (and holds) where it could run.
            return self._blocked(request, route, own[1], own_outcome, stage=own[0])
        return self._blocked(request, route, index, outcome)

    def _index(
        self, request: QueuedRequest, role: Role, *, engines: frozenset[Holder] = frozenset()
    ) -> RouteIndex:
        """The candidate index of ``request``'s route among workers of ``role``: for a
        decode stage, those of its ``kv_engine`` and ``kv_version`` (the prefill worker's:
        a prompt's KV is decoded by the weights that computed it); with ``engines``
        (prefill stages), those whose (engine, model version) is one of them."""
        route: Route = (request.model, request.model_version, request.lane)
        holder: Holder | None = None
        if request.phase == "decode" and (request.kv_engine, request.kv_version) != (None, None):
            holder = (request.kv_engine, request.kv_version)
        if engines:
            owner: object = (self.pipeline, role, engines)
        elif holder is not None:
            owner = (self.pipeline, role, holder)
        else:
            owner = self.pipeline if role == "mixed" else (self.pipeline, role)
        found = cached_route_index(self.snapshot, route, self.ledger, owner)
        if found is not None:  # the usual case: built by an earlier decision on this snapshot
            return found
        admits = route_admits = self._route_admits(request, role=role)
        if engines:

            def admits(worker: WorkerState) -> bool:
                return (worker.engine, worker.model_version) in engines and route_admits(worker)
        elif holder is not None:
            engine, version = holder

            def admits(worker: WorkerState) -> bool:
                return (engine is None or worker.engine == engine) \
                    and (version is None or worker.model_version == version) \
                    and route_admits(worker)
        return route_index(self.snapshot, route, self.ledger, admits, owner)

    def _max_usable(self, index: RouteIndex) -> int:
        """The largest usable KV among ``index``'s members (0 without any), once a cycle."""
        found = self.max_usable.get(id(index))
        if found is None:
            usable = self.ledger.usable_kv
            found = self.max_usable[id(index)] = max(
                (usable(w) for w in index.members), default=0)
        return found

    def _holding_engines(self, decode: RouteIndex, kv_tokens: int) -> frozenset[Holder]:
        """The (engine, model version) pairs of ``decode``'s members of which one could
        hold ``kv_tokens``: where a prompt computed for it may be handed (a worker's largest
        usable KV per pair, once a cycle). By version too: during a rolling upgrade a
        prompt computed with one version's weights must not be decoded with another's."""
        largest = self.usable_by_engine.get(id(decode))
        if largest is None:
            largest = self.usable_by_engine[id(decode)] = {}
            for worker in decode.members:
                usable = self.ledger.usable_kv(worker)
                pair = (worker.engine, worker.model_version)
                if usable > largest.get(pair, -1):
                    largest[pair] = usable
        return frozenset(pair for pair, most in largest.items() if most >= kv_tokens)

    @staticmethod
    def _prefill_stage(request: QueuedRequest, prefill: RouteIndex) -> QueuedRequest:
        """``request`` as a prefill stage: its prompt and the sampled token, in whole
        blocks of the largest block size among the prefill workers (any of them may be
        chosen; rounded to the first one's, a worker of larger blocks was overbooked)."""
        kv = _blocks(request.prompt_tokens + 1, prefill.largest_block)
        return replace(request, phase="prefill", kv_tokens=min(kv, request.kv_tokens),
                       decode_kv_tokens=request.kv_tokens)

    def _overflow(
        self, request: QueuedRequest, route: Route, prefill: RouteIndex, decode: RouteIndex
    ) -> Placement | None:
        """A long request whole on a decode worker with no prompt work, when every
        prefill worker has ``pd_overflow_tokens`` or more to compute (step 6). Within a
        cycle prompt work only grows and room only shrinks, so prefill workers found
        loaded stay loaded, and a route whose overflow found no worker finds none again."""
        threshold = self.pipeline.pd_overflow_tokens
        if not threshold or request.lane != "long" or route in self.no_overflow:
            return None
        if id(prefill) not in self.loaded:
            uncomputed = self.ledger.uncomputed_prompt
            for worker in prefill.members:  # the first below the threshold ends it
                if uncomputed(worker.worker_id) < threshold:
                    return None
            self.loaded.add(id(prefill))
        self.prompt_free = True
        try:
            outcome = self._place(request, decode)
        finally:
            self.prompt_free = False
        if isinstance(outcome, Placement):
            return outcome
        self.no_overflow.add(route)
        return None

    def _spill(self, request: QueuedRequest, own_pool: bool) -> Placement | None:
        """Place ``request`` on the other lane's dedicated pool, if step 5 allows it.
        ``own_pool``: a worker of its own route could hold it (then an overdue head holds
        one of them, step 4, instead of borrowing past the other lane's pending work)."""
        lane, model = request.lane, request.model
        rule = self.pipeline.spill.get(lane)
        if rule is None or self.now - request.enqueued_at < rule.after_s:
            return None
        other = _other(lane)
        # With no worker of its own lane, an overdue head has nothing to hold: it borrows.
        stranded = not own_pool and (
            self.pending.overdue(request, self.now))
        if not stranded and self.pending.has_lane_work(other, model):
            return None  # the other lane has work of its own: lend nothing
        index = self._borrow_index(request)
        if not index.members:
            return None
        self.spill_bound = rule.max_per_worker
        try:
            outcome = self._place(request, index)
        finally:
            self.spill_bound = 0
        return outcome if isinstance(outcome, Placement) else None

    def _borrow_index(self, request: QueuedRequest) -> RouteIndex:
        """The candidate index of the other lane's dedicated pool, for ``request`` to
        borrow (step 5)."""
        other = _other(request.lane)
        route: Route = (request.model, request.model_version, other)
        borrowed = _borrowed(other, self._route_admits(request, lane=other))
        return route_index(self.snapshot, route, self.ledger, borrowed,
                           (self.pipeline, "spill"))

    def _place(self, request: QueuedRequest, index: RouteIndex) -> Placement | str:
        """Place ``request`` on the pipeline's pick, or say why nothing would take it."""
        kv = request.kv_tokens
        top = index.top_room()
        if top < kv:
            return f"no room: largest free {top} < {kv}"
        candidates = self._candidates(index, request)
        if not candidates:
            return f"refused by {self.refusal}"
        worker = self._choose(candidates, request)
        if not self.ledger.reserve(worker, request):  # kv-fits makes this unreachable
            return "ledger refused the reservation"
        self.pending.lanes.charge(request.lane, shared=worker.pool == "any")
        self.pending.remove(request.request_id)
        return Placement(request, worker.worker_id, worker.partition, kv, request.attempt)

    def _route_admits(
        self, request: QueuedRequest, *, lane: Lane | None = None, role: Role = "mixed"
    ) -> Callable[[WorkerState], bool]:
        """The route-stage filters for ``request`` (as if of ``lane``, when given), among
        workers of ``role``."""
        filters, ctx = self.pipeline.route_filters, self.ctx
        if lane is not None and lane != request.lane:
            request = replace(request, lane=lane)

        def admits(worker: WorkerState) -> bool:
            return worker.role == role and all(f.accepts(worker, request, ctx) for f in filters)

        return admits

    def _candidates(self, index: RouteIndex, request: QueuedRequest) -> list[WorkerState]:
        """Candidates: the K roomiest members (or all) that fit, + the affinity worker.

        Fitting (room >= kv_tokens) is the kv-fits and seq-slots rule, enforced by the
        index; holds and any room-stage filters are checked here.
        """
        kv, limit = request.kv_tokens, self.pipeline.candidates
        found: list[WorkerState] = []
        if limit == 0:
            found = index.fitting(kv)
            if self.pipeline.room_filters or self.spill_bound or self.prompt_free \
                    or self.ledger.hold_count():
                found = self._admitted(found, request)
        else:
            roomiest = index.roomiest(kv)
            # Judged in batches of as many as are still missing: the same workers as one
            # at a time (none past the K-th admitted), with one filter call per batch.
            while len(found) < limit:
                batch = list(itertools.islice(roomiest, limit - len(found)))
                if not batch:
                    break
                found += self._admitted(batch, request)
            roomiest.close()  # pushes the popped entries back before anything changes
        affine = self.ledger.affinity.get(request.prefix_hash)
        if affine is not None:
            i = index.pos.get(affine)
            if i is not None and index.room[i] >= kv:
                worker = index.members[i]
                if all(w is not worker for w in found) and self._admitted([worker], request):
                    found.append(worker)
        return found

    def _admitted(self, workers: list[WorkerState], request: QueuedRequest) -> list[WorkerState]:
        """The ``workers`` that ``request`` may use, in their order: the cycle's own checks
        (:meth:`_own_refusal`), then each room filter, asked once for all the workers still
        in (like scorers: one call per filter and batch, not one per worker). ``refusal``
        ends as why the last refused worker was refused, as when judged one at a time."""
        why: dict[int, str] = {}  # position in workers -> the first check that refused it
        left: Sequence[int] = range(len(workers))  # positions not refused yet
        if self.spill_bound or self.prompt_free or self.ledger.hold_count():
            for i in left:
                reason = self._own_refusal(workers[i], request)
                if reason is not None:
                    why[i] = reason
            left = [i for i in left if i not in why]
        for room_filter in self.pipeline.room_filters:
            if not left:
                break
            batch = workers if len(left) == len(workers) else [workers[i] for i in left]
            verdicts = room_filter.accepts_each(batch, request, self.ctx)
            if all(verdicts):  # the usual case
                continue
            for i, ok in zip(left, verdicts, strict=True):
                if not ok:
                    why[i] = room_filter.name
            left = [i for i in left if i not in why]
        if not why:
            return workers
        self.refusal = why[max(why)]
        return [workers[i] for i in left]

    def _own_refusal(self, worker: WorkerState, request: QueuedRequest) -> str | None:
        """Why the cycle itself keeps ``request`` off ``worker`` (None: it does not): a
        spill's per-worker bound, an overflow's prompt-free rule, a hold for another."""
        ledger, worker_id = self.ledger, worker.worker_id
        if self.spill_bound and ledger.lane_count(worker_id, request.lane) >= self.spill_bound:
            return "spill bound"
        if self.prompt_free and ledger.uncomputed_prompt(worker_id):
            return "prompt work"
        holder = ledger.holder(worker_id)
        if holder is not None and holder != request.request_id:
            self.hold_refused = True
            return "hold"
        return None

    def _choose(self, candidates: list[WorkerState], request: QueuedRequest) -> WorkerState:
        """Weighted mean of the scorers, then the picker."""
        pipeline, ctx = self.pipeline, self.ctx
        if len(candidates) == 1:
            return candidates[0]
        if pipeline.picker.uses_scores and pipeline.scorers:
            columns = [scorer.scores(candidates, request, ctx) for scorer, _ in pipeline.scorers]
            weights = pipeline.weights
            totals = [sum(map(mul, weights, row)) for row in zip(*columns, strict=True)]
        else:
            totals = [0.0] * len(candidates)
        scored: list[Scored] = list(zip(totals, candidates, strict=True))
        ctx.route = (request.model, request.model_version, request.lane)
        return pipeline.picker.pick(scored, self.rng, ctx)

    def _blocked(
        self,
        request: QueuedRequest,
        route: Route,
        index: RouteIndex,
        reason: str,
        *,
        stage: QueuedRequest | None = None,
    ) -> Decision:
        """A head that fits nowhere now: reject if it never could, else defer (and hold).
        ``stage``: the request as it would be placed on ``index`` (its prefill stage, or
        itself whole on a decode worker)."""
        request_id, kv = request.request_id, request.kv_tokens
        fleet = capacity(self.snapshot, route, self.ledger)
        if not fleet.any_live:
            return Defer(request_id, "no fresh worker in the fleet: saturated")
        lane_served, accepting, max_usable = fleet.lane_served, fleet.accepting, fleet.max_usable
        recent_usable = fleet.recent_usable
        if request.lane in self.pipeline.spill:  # it may borrow the other lane's pool (step 5)
            other = capacity(self.snapshot, (route[0], route[1], _other(request.lane)),
                             self.ledger)
            lane_served = lane_served or other.lane_served
            accepting += other.accepting
            max_usable = max(max_usable, other.max_usable)
            recent_usable = max(recent_usable, other.recent_usable)
        never = None
        if not fleet.version_served:
            what = (
                f"model {request.model}"
                if not fleet.model_served
                else f"{request.model} version {request.model_version}"
            )
            never = Reject(request_id, "unknown_model", f"no live worker serves {what}")
        elif not lane_served:
            never = Reject(request_id, "too_large", f"no live worker takes the {route[2]} lane")
        elif accepting == 0:
            return Defer(request_id, "only draining or prefill workers serve this route")
        elif max_usable < kv:
            never = Reject(
                request_id, "too_large", f"needs {kv} KV tokens, largest usable {max_usable}"
            )
        if never is not None and accepting == 0 and recent_usable >= kv:
            # No live worker takes this route now, and one heard from lately (restarting,
            # late) would take it: it waits for that worker, or for its deadline, rather
            # than be refused for good. Only then: with live workers that are merely too
            # small, the deferred head would hold its class's smaller requests back for
            # minutes (found by a review of f4d1301); it is refused too_large as before.
            return Defer(request_id, f"waits for a worker heard from lately: {never.reason} "
                         "now")
        if never is not None:
            self.pending.remove(request_id)
            self.ledger.unhold(request_id)
            return never
        if not fleet.lane_served:
            reason = (f"no live worker of the {request.lane} pool; waits to borrow the "
                      f"{_other(request.lane)} pool")
        if self.pending.overdue(request, self.now):
            placed = stage if stage is not None else request
            before = self.ledger.hold_of(request_id)
            held = self._hold(placed, index)
            if held is not None and held != before and self.hold_refused:
                # It took over a hold that had kept it out: that worker may fit it now.
                self.hold_refused = False
                outcome = self._place(placed, index)
                if isinstance(outcome, Placement):
                    return outcome
            if held is not None:
                reason = f"{reason}; holding {held}"
        return Defer(request_id, reason)

    def _hold(self, request: QueuedRequest, index: RouteIndex) -> str | None:
        """Keep (or pick) the worker held for an overdue head.

        The pick is the route member with the most room (then, if none has any, the most
        free KV) whose usable KV could take the request, among workers not held for a
        request ahead of this one in effective priority: a hold for a request behind it is
        taken over, so holds follow priority.
        """
        ledger, kv = self.ledger, request.kv_tokens
        current = ledger.hold_of(request.request_id)
        if current is not None:
            i = index.pos.get(current)
            if i is not None and ledger.usable_kv(index.members[i]) >= kv:
                return current
        mine = self.pending.order_key(request)
        target: WorkerState | None = None
        roomiest = index.roomiest(1)
        for worker in roomiest:  # usually the first few: O(log n)
            if self._may_hold(worker, mine, kv):
                target = worker
                break
        roomiest.close()
        if target is None:  # no member has room at all: O(route), once per new hold
            best_free = -1
            for worker in index.members:
                if self._may_hold(worker, mine, kv) and ledger.free_kv(worker) > best_free:
                    target, best_free = worker, ledger.free_kv(worker)
        if target is None:
            if current is not None:  # its worker can no longer take it: free that worker
                ledger.unhold(request.request_id)
            return None
        ledger.hold(target.worker_id, request.request_id)
        return target.worker_id

    def _may_hold(self, worker: WorkerState, mine: float, kv: int) -> bool:
        holder = self.ledger.holder(worker.worker_id)
        if holder is not None:
            other = self.pending.get(holder)
            if other is not None and self.pending.order_key(other) <= mine:
                return False  # held for a request ahead of this one
        return self.ledger.usable_kv(worker) >= kv
