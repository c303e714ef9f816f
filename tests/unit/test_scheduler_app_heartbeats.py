"""The scheduler's heartbeat handler (``Scheduler._on_heartbeat``) with the Faust app and
the log reader as stand-ins: a heartbeat naming a partition the assignments topic does not
have keeps its worker out of the fleet. The first of each worker process is refused with a
``SchemaError`` on field ``partition`` (the guard dead-letters it); the next ones of the
same process are dropped without another dead letter, one a second otherwise. The real
broker's side is ``tests/integration/test_scheduler_service.py``."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from schemas.codec import SchemaError, encode
from services.common.settings import Settings
from services.scheduler import app as scheduler_app
from services.scheduler.app import Scheduler, SchedulerRuntime
from services.scheduler.runtime.topics import SchedulerTopics
from services.scheduler.settings import SchedulerSettings
from tests.builders_schemas import make_heartbeat

T = 1_700_000_000.0
SLOTS = 4


def _scheduler() -> Scheduler:
    settings = Settings()
    rt = SchedulerRuntime(settings, SchedulerSettings(replicas=1),
                          SchedulerTopics.of(settings.topic_prefix, SLOTS), clock=lambda: T)
    scheduler = Scheduler(rt, SimpleNamespace())  # type: ignore[arg-type]
    assignments = rt.topics.assignments
    scheduler.reader.partitions = (  # type: ignore[method-assign]
        lambda topic: frozenset(range(SLOTS)) if topic == assignments else frozenset())
    return scheduler


def _beat(worker_id: str, partition: int, started_at: float = T - 60) -> Any:
    hb = make_heartbeat(worker_id=worker_id, partition=partition, started_at=started_at, ts=T)
    return SimpleNamespace(value=encode(hb), key=worker_id.encode(), partition=0)


def test_a_heartbeat_of_a_partition_the_topic_has_joins_the_fleet() -> None:
    scheduler = _scheduler()
    scheduler._on_heartbeat(_beat("w-ok", SLOTS - 1))
    assert "w-ok" in scheduler.state.fleet


def test_one_naming_a_partition_the_topic_lacks_is_refused_naming_the_field() -> None:
    scheduler = _scheduler()
    with pytest.raises(SchemaError) as refused:
        scheduler._on_heartbeat(_beat("stray", SLOTS))
    assert refused.value.field == "partition"
    assert f"{SLOTS} is not a partition of" in str(refused.value)
    assert f"0 to {SLOTS - 1}" in str(refused.value)
    assert "stray" not in scheduler.state.fleet


def test_the_same_process_is_refused_once_then_only_counted(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler_app, "_STRAY_LOG_EVERY", 3)
    scheduler = _scheduler()
    with pytest.raises(SchemaError):
        scheduler._on_heartbeat(_beat("stray", 9))
    with caplog.at_level(logging.WARNING, logger="services.scheduler"):
        for _ in range(5):
            scheduler._on_heartbeat(_beat("stray", 9))  # no dead letter: returns
    assert "stray" not in scheduler.state.fleet
    said = [r.getMessage() for r in caplog.records if "still heartbeats" in r.getMessage()]
    assert said == [f"scheduler: worker stray still heartbeats partition 9, which "
                    f"{scheduler.rt.topics.assignments} does not have (3 heartbeats since "
                    f"the dead letter)"]
    with pytest.raises(SchemaError):  # a new process of it: dead-lettered once again
        scheduler._on_heartbeat(_beat("stray", 9, started_at=T - 1))


def test_the_stray_processes_remembered_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    # One entry per stray process, never forgotten: a flood of ids, or one stray worker
    # restarting, grew it for good (an audit of unbounded memory).
    monkeypatch.setattr(scheduler_app, "_STRAYS_KEPT", 10)
    scheduler = _scheduler()
    for i in range(50):
        with pytest.raises(SchemaError):
            scheduler._on_heartbeat(_beat(f"stray-{i}", SLOTS))
    assert len(scheduler._strays) == 10
    scheduler._on_heartbeat(_beat("stray-49", SLOTS))  # the newest are still known
