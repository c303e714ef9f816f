"""Pure rules of worker health: state from a heartbeat, desired registry state, reconcile plan.

No Kafka, Consul or HTTP here; ``now`` is passed in. The health service, ``llmq status`` and
``llmq drain`` all classify workers with :func:`worker_state`, so they never disagree.

**Worker state** (:func:`worker_state`), from the newest heartbeat of a worker (ordered by
``(started_at, seq)``), ``now`` and a :class:`HealthPolicy`:

=====================================================================  ==========
condition                                                              state
=====================================================================  ==========
a tombstone (null value) followed the heartbeat                        ``gone``
fresh: ``|now - ts| <= staleness × interval_s``, ``draining``          ``draining``
fresh, not draining                                                    ``up``
not fresh, last beat draining with nothing running or waiting          ``gone``
not fresh, ``now - ts > gone_after`` (below)                           ``gone``
not fresh otherwise                                                    ``stale``
=====================================================================  ==========

Fail closed: anything we cannot vouch for is not ``up``. A heartbeat from the future beyond
the freshness window (a skewed clock) is as unknown as an old one, so it is ``stale`` too.
A drained worker that stopped beating exited on purpose (its last heartbeat says draining,
nothing running), so it is ``gone`` at once rather than ``stale``.

``gone_after`` (:func:`gone_after`) is ``max(gone_after_s, 2 × staleness × interval_s)``:
a silent worker is ``stale`` for at least one freshness window before it is ``gone``. With
the defaults (staleness 3, 60 s) that changes nothing up to a 10 s heartbeat interval; a
worker beating every 30 s (window 90 s) would otherwise go from ``up`` straight to ``gone``,
never shown or flagged as ``stale``.

**Desired registry state** (:func:`desired_state`), per worker:

==========  ==============  ===========  =============================================
state       registered      TTL check    maintenance
==========  ==============  ===========  =============================================
up          yes             passing      off, unless a drain command is pending for it
draining    yes             passing      on ("draining")
stale       yes             critical     as for up/draining (from the last heartbeat)
gone        no (deregister) —            —
==========  ==============  ===========  =============================================

A stale worker's check is failed explicitly rather than left to expire: the operator sees
why (the note), and a TTL longer than the staleness window cannot keep it green.

A worker whose heartbeat names a slot that is not a partition of the assignments topic
(``slots`` partitions, when the caller knows them) is registered with a **critical** check
whatever its state: the schedulers refuse such a heartbeat and place nothing there, so it
must not be discovered as serving (:func:`stray_note`). A drain
command (``DrainWorker`` on ``llmq.control``) issued after the worker process started puts
it in maintenance at once, before its draining heartbeat arrives.

**Reconcile** (:func:`reconcile`) compares the desired state with what was last applied and
returns one :class:`Plan` of actions (data) per service id; the service performs them. The
TTL check is passed again for every new heartbeat (``beat`` changes), so the TTL is the
worker's own liveness, not the health service's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from schemas.workers import WorkerHeartbeat
from services.health.registry import CheckStatus, ServiceRegistration

WorkerState = Literal["up", "draining", "stale", "gone"]
WORKER_STATES: Final[tuple[WorkerState, ...]] = ("up", "draining", "stale", "gone")

#: Consul service name of every worker instance (service id = worker_id).
WORKER_SERVICE: Final = "llmq-worker"


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """When a heartbeat counts, and how long a silent worker stays registered."""

    #: A heartbeat is fresh within this many of its own ``interval_s`` (DESIGN.md: 3).
    staleness: float = 3.0
    #: A worker silent this long is deregistered (``gone``); never sooner than
    #: :func:`gone_after` allows.
    gone_after_s: float = 60.0
    #: Smallest TTL given to a check; the TTL is ``max(min_ttl_s, staleness × interval_s)``
    #: so that a worker with a long interval is not flagged between two beats.
    min_ttl_s: float = 10.0


@dataclass(frozen=True, slots=True)
class DrainRequest:
    """A ``DrainWorker`` command seen on ``llmq.control``."""

    reason: str
    issued_at: float


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """Everything known of one worker: its newest heartbeat, a tombstone, a drain command."""

    heartbeat: WorkerHeartbeat
    tombstoned: bool = False
    drain: DrainRequest | None = None

    @property
    def worker_id(self) -> str:
        return self.heartbeat.worker_id


def freshness_window(hb: WorkerHeartbeat, policy: HealthPolicy) -> float:
    """Seconds a heartbeat stays fresh: ``staleness × interval_s``."""
    return policy.staleness * hb.interval_s


def gone_after(hb: WorkerHeartbeat, policy: HealthPolicy) -> float:
    """Seconds of silence after which the worker is ``gone`` (module docstring)."""
    return max(policy.gone_after_s, 2 * freshness_window(hb, policy))


def is_fresh(hb: WorkerHeartbeat, now: float, policy: HealthPolicy) -> bool:
    """Within the freshness window on either side of ``now`` (see the module docstring)."""
    return abs(now - hb.ts) <= freshness_window(hb, policy)


def drained(hb: WorkerHeartbeat) -> bool:
    """The heartbeat of a worker that finished its drain: draining, nothing in flight."""
    return hb.draining and hb.running == 0 and hb.waiting == 0


def worker_state(rec: WorkerRecord, now: float, policy: HealthPolicy) -> WorkerState:
    """The state table of the module docstring."""
    hb = rec.heartbeat
    if rec.tombstoned:
        return "gone"
    if is_fresh(hb, now, policy):
        return "draining" if hb.draining else "up"
    if drained(hb) or now - hb.ts > gone_after(hb, policy):
        return "gone"
    return "stale"


def maintenance_reason(rec: WorkerRecord) -> str | None:
    """Why the worker should be in maintenance, or None.

    A drain command counts only if issued after this worker process started: an old
    command for a previous incarnation must not keep a restarted worker out of rotation.
    """
    if rec.heartbeat.draining:
        return "llmq: draining"
    if rec.drain is not None and rec.drain.issued_at >= rec.heartbeat.started_at:
        suffix = f": {rec.drain.reason}" if rec.drain.reason else ""
        return f"llmq: drain requested{suffix}"
    return None


def is_stray(hb: WorkerHeartbeat, slots: int | None) -> bool:
    """The heartbeat names a slot the assignments topic (``slots`` partitions) lacks;
    ``slots`` None: not known, nothing is a stray."""
    return slots is not None and not 0 <= hb.partition < slots


def stray_note(hb: WorkerHeartbeat, slots: int) -> str:
    """Why a stray worker is refused, and what to do (the check's note, the status warning)."""
    return (f"refused by the schedulers: slot {hb.partition} is not a partition of the "
            f"assignments topic ({slots} partitions), so no work is placed on "
            f"{hb.worker_id}; give it a slot below {slots}, or restart the schedulers if "
            "partitions were added")


def worker_registration(hb: WorkerHeartbeat, policy: HealthPolicy) -> ServiceRegistration:
    """The ``llmq-worker`` instance of a worker; tags carry pool, model and engine (and
    the role of a prefill or decode worker)."""
    return ServiceRegistration(
        name=WORKER_SERVICE,
        service_id=hb.worker_id,
        tags=(f"pool:{hb.pool}", f"model:{hb.model}", f"engine:{hb.engine}",
              *((f"role:{hb.role}",) if hb.role != "mixed" else ())),
        meta=(("slot", str(hb.partition)),),
        ttl_s=max(policy.min_ttl_s, freshness_window(hb, policy)),
    )


@dataclass(frozen=True, slots=True)
class Desired:
    """What the registry should hold for one service id."""

    registration: ServiceRegistration
    check: CheckStatus
    #: Output shown with the check (why it is critical, or the last heartbeat).
    note: str
    #: Identity of the liveness proof behind a passing check (heartbeat ``(started_at,
    #: seq)``); a new one passes the TTL check again.
    beat: tuple[float, int]
    #: Maintenance reason, None when not in maintenance.
    maintenance: str | None = None


def desired_state(
    rec: WorkerRecord, now: float, policy: HealthPolicy, slots: int | None = None
) -> Desired | None:
    """The desired-state table of the module docstring; None means "not registered".
    ``slots``: partitions of the assignments topic, when known (a stray's check fails)."""
    state = worker_state(rec, now, policy)
    if state == "gone":
        return None
    hb = rec.heartbeat
    age = now - hb.ts
    if state == "stale":
        check: CheckStatus = "critical"
        limit = freshness_window(hb, policy)
        note = (f"stale: no heartbeat for {age:.1f}s (limit {limit:g}s)" if age >= 0 else
                f"stale: last heartbeat stamped {-age:.1f}s in the future (limit {limit:g}s; "
                "is a clock skewed?)")
    else:
        check = "passing"
        note = f"{state}: heartbeat seq {hb.seq}, {hb.running} running, {hb.waiting} waiting"
    if check == "passing" and slots is not None and is_stray(hb, slots):
        check, note = "critical", stray_note(hb, slots)
    return Desired(
        registration=worker_registration(hb, policy),
        check=check,
        note=note,
        beat=(hb.started_at, hb.seq),
        maintenance=maintenance_reason(rec),
    )


def desired_fleet(
    records: Mapping[str, WorkerRecord], now: float, policy: HealthPolicy,
    slots: int | None = None,
) -> dict[str, Desired]:
    """Desired state of every worker that should be registered, by service id."""
    wanted: dict[str, Desired] = {}
    for worker_id, rec in records.items():
        d = desired_state(rec, now, policy, slots)
        if d is not None:
            wanted[worker_id] = d
    return wanted


# ---- reconcile --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Register:
    registration: ServiceRegistration


@dataclass(frozen=True, slots=True)
class SetCheck:
    service_id: str
    status: CheckStatus
    note: str


@dataclass(frozen=True, slots=True)
class SetMaintenance:
    service_id: str
    #: None: leave maintenance.
    reason: str | None


@dataclass(frozen=True, slots=True)
class Deregister:
    service_id: str


Action = Register | SetCheck | SetMaintenance | Deregister


@dataclass(frozen=True, slots=True)
class Plan:
    """Actions for one service id, in order; ``after`` is what is applied once all succeed
    (None: nothing registered any more)."""

    service_id: str
    actions: tuple[Action, ...]
    after: Desired | None


#: ``applied`` value for an instance found in the registry whose state we do not know (left
#: by an earlier run): it is re-registered, or deregistered if nobody wants it.
UNKNOWN: Final = None


def reconcile(
    desired: Mapping[str, Desired], applied: Mapping[str, Desired | None]
) -> list[Plan]:
    """Plans that take the registry from ``applied`` to ``desired``, sorted by service id.

    ``applied`` maps each service id we believe registered to what we last applied there
    (:data:`UNKNOWN` when we found it registered but do not know its state). Ids with
    nothing to do get no plan.
    """
    plans: list[Plan] = []
    for service_id in sorted(desired.keys() | applied.keys()):
        want = desired.get(service_id)
        if want is None:
            plans.append(Plan(service_id, (Deregister(service_id),), None))
            continue
        actions = _actions(service_id, want, applied.get(service_id), service_id in applied)
        if actions:
            plans.append(Plan(service_id, actions, want))
    return plans


def _actions(
    service_id: str, want: Desired, have: Desired | None, present: bool
) -> tuple[Action, ...]:
    actions: list[Action] = []
    fresh_registration = have is None or have.registration != want.registration
    if fresh_registration:
        actions.append(Register(want.registration))
    # Maintenance is a separate check in Consul. A registration that replaces the
    # service's checks (replace-existing-checks) drops it, so it is set again after every
    # registration; an instance of unknown state gets an explicit "off" too.
    have_maintenance = None if have is None else have.maintenance
    if (want.maintenance != have_maintenance or (have is None and present)
            or (fresh_registration and want.maintenance is not None)):
        actions.append(SetMaintenance(service_id, want.maintenance))
    check_changed = have is None or fresh_registration or have.check != want.check
    if check_changed or (want.check == "passing" and have is not None and have.beat != want.beat):
        actions.append(SetCheck(service_id, want.check, want.note))
    return tuple(actions)
