"""The health state machine: worker state, desired registry state, reconcile plans (tables)."""

from __future__ import annotations

from typing import Any

import pytest

from services.health.core import (
    UNKNOWN,
    WORKER_SERVICE,
    Deregister,
    Desired,
    DrainRequest,
    HealthPolicy,
    Register,
    SetCheck,
    SetMaintenance,
    WorkerRecord,
    WorkerState,
    desired_fleet,
    desired_state,
    is_fresh,
    reconcile,
    worker_state,
)
from tests.builders_schemas import make_heartbeat

NOW = 1_000_000.0
POLICY = HealthPolicy(staleness=3.0, gone_after_s=60.0, min_ttl_s=10.0)


def rec(age_s: float = 0.0, *, tombstoned: bool = False, drain: DrainRequest | None = None,
        **changes: Any) -> WorkerRecord:
    """A worker whose newest heartbeat is ``age_s`` old (interval 1 s: fresh ≤ 3 s)."""
    fields: dict[str, Any] = {"worker_id": "w1", "ts": NOW - age_s, "interval_s": 1.0,
                              "started_at": NOW - 3600.0, "seq": 10, "draining": False,
                              "running": 2, "waiting": 1}
    fields.update(changes)
    return WorkerRecord(make_heartbeat(**fields), tombstoned, drain)


@pytest.mark.parametrize(
    ("record", "state"),
    [
        (rec(0.0), "up"),
        (rec(3.0), "up"),                                  # the window is inclusive
        (rec(3.01), "stale"),
        (rec(59.0), "stale"),
        (rec(60.5), "gone"),                               # silent longer than gone_after_s
        (rec(0.5, draining=True), "draining"),
        (rec(5.0, draining=True), "stale"),                # draining with work left, silent
        (rec(5.0, draining=True, running=0, waiting=0), "gone"),   # drained and exited
        (rec(5.0, draining=True, running=0, waiting=1), "stale"),  # still had work queued
        (rec(0.0, tombstoned=True), "gone"),
        (rec(-2.0), "up"),                                 # small clock skew is tolerated
        (rec(-10.0), "stale"),                             # a beat from the future: unknown
        (rec(20.0, interval_s=10.0), "up"),                # window scales with interval_s
    ],
)
def test_worker_state(record: WorkerRecord, state: WorkerState) -> None:
    assert worker_state(record, NOW, POLICY) == state


def test_freshness_follows_the_policy() -> None:
    hb = rec(4.0).heartbeat
    assert not is_fresh(hb, NOW, POLICY)
    assert is_fresh(hb, NOW, HealthPolicy(staleness=5.0))


@pytest.mark.parametrize(
    ("record", "check", "maintenance"),
    [
        (rec(0.0), "passing", None),
        (rec(0.0, draining=True), "passing", "llmq: draining"),
        (rec(10.0), "critical", None),
        (rec(10.0, draining=True), "critical", "llmq: draining"),
        # A drain command issued after the process started: maintenance before the
        # worker's own draining heartbeat arrives.
        (rec(0.0, drain=DrainRequest("rollout", NOW - 1.0)), "passing",
         "llmq: drain requested: rollout"),
        (rec(0.0, drain=DrainRequest("", NOW - 1.0)), "passing", "llmq: drain requested"),
        # ...but one for an earlier incarnation does not keep a restarted worker out.
        (rec(0.0, drain=DrainRequest("old", NOW - 7200.0)), "passing", None),
    ],
)
def test_desired_state(record: WorkerRecord, check: str, maintenance: str | None) -> None:
    d = desired_state(record, NOW, POLICY)
    assert d is not None
    assert (d.check, d.maintenance) == (check, maintenance)
    assert d.registration.name == WORKER_SERVICE
    assert d.registration.service_id == "w1"
    assert d.beat == (record.heartbeat.started_at, record.heartbeat.seq)


@pytest.mark.parametrize("record", [rec(0.0, tombstoned=True), rec(120.0),
                                    rec(5.0, draining=True, running=0, waiting=0)])
def test_gone_workers_are_not_registered(record: WorkerRecord) -> None:
    assert desired_state(record, NOW, POLICY) is None


def test_registration_tags_and_ttl() -> None:
    d = desired_state(rec(0.0, pool="short", model="m/x", engine="sim", partition=4,
                          interval_s=5.0), NOW, POLICY)
    assert d is not None
    assert d.registration.tags == ("pool:short", "model:m/x", "engine:sim")
    assert dict(d.registration.meta) == {"slot": "4"}
    assert d.registration.ttl_s == 15.0  # max(min_ttl_s, 3 × 5 s)
    small = desired_state(rec(0.0), NOW, POLICY)
    assert small is not None and small.registration.ttl_s == 10.0
    decode = desired_state(rec(0.0, pool="any", model="m", engine="sim", role="decode"),
                           NOW, POLICY)
    assert decode is not None
    assert decode.registration.tags == ("pool:any", "model:m", "engine:sim", "role:decode")


def test_stale_note_says_why() -> None:
    d = desired_state(rec(12.0), NOW, POLICY)
    assert d is not None and "no heartbeat for 12.0s" in d.note


@pytest.mark.parametrize(
    ("age_s", "state"),
    [
        (90.0, "up"),       # 3 × 30 s: still fresh
        (91.0, "stale"),    # gone_after_s (60 s) alone would make it gone here, never stale
        (179.0, "stale"),
        (181.0, "gone"),    # past twice the freshness window
    ],
)
def test_a_slow_heartbeat_is_stale_before_it_is_gone(age_s: float, state: WorkerState) -> None:
    assert worker_state(rec(age_s, interval_s=30.0), NOW, POLICY) == state


def test_a_heartbeat_from_the_future_is_described_as_such() -> None:
    d = desired_state(rec(-999_000.0), NOW, POLICY)
    assert d is not None and d.check == "critical"
    assert "stamped 999000.0s in the future" in d.note and "-999000" not in d.note


# ---- reconcile ---------------------------------------------------------------------------

def want(record: WorkerRecord) -> Desired:
    d = desired_state(record, NOW, POLICY)
    assert d is not None
    return d


UP = want(rec(0.0))
UP_NEXT_BEAT = want(rec(0.0, seq=11))
STALE = want(rec(10.0))
DRAINING = want(rec(0.0, draining=True, seq=11))
OTHER_POOL = want(rec(0.0, pool="long"))
DRAINING_OTHER_POOL = want(rec(0.0, draining=True, seq=11, pool="long"))


def kinds(actions: tuple[Any, ...]) -> list[str]:
    out = []
    for a in actions:
        match a:
            case Register():
                out.append("register")
            case SetCheck(status=status):
                out.append(f"check:{status}")
            case SetMaintenance(reason=reason):
                out.append("maint:on" if reason else "maint:off")
            case Deregister():
                out.append("deregister")
    return out


@pytest.mark.parametrize(
    ("desired", "applied", "expected"),
    [
        # new fresh worker: register, pass
        ({"w1": UP}, {}, ["register", "check:passing"]),
        # same beat, already applied: nothing
        ({"w1": UP}, {"w1": UP}, []),
        # every new heartbeat passes the TTL check again
        ({"w1": UP_NEXT_BEAT}, {"w1": UP}, ["check:passing"]),
        # fresh → stale: fail the check explicitly
        ({"w1": STALE}, {"w1": UP}, ["check:critical"]),
        # stale stays stale: no repeated calls
        ({"w1": STALE}, {"w1": STALE}, []),
        # stale → fresh again
        ({"w1": UP}, {"w1": STALE}, ["check:passing"]),
        # draining heartbeat: maintenance on (and the new beat passes)
        ({"w1": DRAINING}, {"w1": UP}, ["maint:on", "check:passing"]),
        # a worker that starts draining is registered straight into maintenance
        ({"w1": DRAINING}, {}, ["register", "maint:on", "check:passing"]),
        # gone: deregister
        ({}, {"w1": UP}, ["deregister"]),
        # found in the registry from an earlier run, nobody wants it: deregister
        ({}, {"w1": UNKNOWN}, ["deregister"]),
        # found from an earlier run, still alive: register again, maintenance off, pass
        ({"w1": UP}, {"w1": UNKNOWN}, ["register", "maint:off", "check:passing"]),
        # tags changed (pool): re-register and re-pass
        ({"w1": OTHER_POOL}, {"w1": UP}, ["register", "check:passing"]),
        # re-registered while in maintenance: a registration that replaces the checks
        # may drop the maintenance check, so it is set again
        ({"w1": DRAINING_OTHER_POOL}, {"w1": DRAINING},
         ["register", "maint:on", "check:passing"]),
        # nothing anywhere: nothing to do
        ({}, {}, []),
    ],
)
def test_reconcile(desired: dict[str, Desired], applied: dict[str, Desired | None],
                   expected: list[str]) -> None:
    plans = reconcile(desired, applied)
    got = [k for p in plans for k in kinds(p.actions)]
    assert got == expected
    for plan in plans:
        assert plan.after == desired.get(plan.service_id)


def test_reconcile_sorted_and_only_ids_with_work() -> None:
    plans = reconcile({"b": UP, "a": UP, "c": UP}, {"c": UP})
    assert [p.service_id for p in plans] == ["a", "b"]


def test_desired_fleet_drops_gone_workers() -> None:
    records = {"w1": rec(0.0), "w2": rec(0.0, worker_id="w2", tombstoned=True),
               "w3": rec(10.0, worker_id="w3")}
    fleet = desired_fleet(records, NOW, POLICY)
    assert sorted(fleet) == ["w1", "w3"]
    assert fleet["w3"].check == "critical"


def test_a_worker_beating_a_slot_the_assignments_topic_lacks_is_critical() -> None:
    """The schedulers refuse such a heartbeat: it must not be discovered as serving."""
    stray = desired_state(rec(partition=5), NOW, POLICY, slots=4)
    assert stray is not None and stray.check == "critical"
    assert "slot 5 is not a partition of the assignments topic (4 partitions)" in stray.note
    assert "restart the schedulers" in stray.note
    placed = desired_state(rec(partition=3), NOW, POLICY, slots=4)
    assert placed is not None and placed.check == "passing"
    # Topic not read (slots None): as before, nothing is a stray.
    unknown = desired_state(rec(partition=5), NOW, POLICY)
    assert unknown is not None and unknown.check == "passing"
    # A stale stray says it is stale (its beats stopped); a drain still puts it in maintenance.
    stale = desired_state(rec(10.0, partition=5), NOW, POLICY, slots=4)
    assert stale is not None and stale.check == "critical" and stale.note.startswith("stale")
    draining = desired_state(rec(partition=5, draining=True), NOW, POLICY, slots=4)
    assert draining is not None and draining.check == "critical"
    assert draining.maintenance == "llmq: draining"
    fleet = desired_fleet({"w1": rec(partition=5)}, NOW, POLICY, slots=4)
    assert fleet["w1"].check == "critical"
