"""The health service's tick, driven synchronously: fleet state in, registry calls out.

No Kafka here: the test plays the feed (observes heartbeats into the tracker, marks the
topic read) and the clock; the registry is the in-memory fake of tests/fakes.
"""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import generate_latest

from schemas.control import DrainWorker
from services.common.settings import Settings
from services.health.core import WORKER_SERVICE
from services.health.registry import ServiceRegistration
from services.health.service import HEALTH_SERVICE, HealthService
from services.health.settings import HealthSettings
from tests.fakes.health_registry import InMemoryRegistry
from tests.fakes.heartbeat_worker import heartbeat

T0 = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def registry() -> InMemoryRegistry:
    return InMemoryRegistry()


@pytest.fixture
def service(registry: InMemoryRegistry, clock: Clock) -> HealthService:
    hs = HealthSettings(port=18999, instance_id="test", gone_after_s=60.0)
    svc = HealthService(Settings(topic_prefix="unit"), hs, registry=registry, clock=clock)
    svc.kafka_ok = True
    return svc


def beat(svc: HealthService, clock: Clock, worker_id: str, seq: int, **changes: Any) -> None:
    svc.tracker.observe_heartbeat(heartbeat(worker_id, ts=clock.now, started_at=T0 - 100,
                                            seq=seq, interval_s=1.0, **changes))


async def test_nothing_is_registered_before_the_topic_was_read(
    service: HealthService, registry: InMemoryRegistry, clock: Clock
) -> None:
    beat(service, clock, "w1", 1)
    await service.tick()
    assert registry.calls == []
    assert not service.ready()


async def test_lifecycle_fresh_stale_draining_gone(
    service: HealthService, registry: InMemoryRegistry, clock: Clock
) -> None:
    beat(service, clock, "w1", 1)
    beat(service, clock, "w2", 1)
    service.heartbeats_caught_up.set()
    await service.tick()
    w1, w2 = registry.instances["w1"], registry.instances["w2"]
    assert (w1.check, w2.check) == ("passing", "passing")
    assert w1.registration.name == WORKER_SERVICE
    assert registry.instances[service.own_id].registration.name == HEALTH_SERVICE
    assert registry.instances[service.own_id].check == "passing"

    # A new heartbeat passes the TTL again; a tick without one does nothing for w2.
    clock.now += 1
    beat(service, clock, "w1", 2)
    await service.tick()
    assert (w1.passes, w2.passes) == (2, 1)

    # w2 goes silent: critical once the window (3 × 1 s) is over.
    clock.now += 4
    beat(service, clock, "w1", 3)
    await service.tick()
    assert w2.check == "critical" and "no heartbeat" in w2.note
    assert w1.check == "passing"

    # w1 starts draining: maintenance.
    beat(service, clock, "w1", 4, draining=True, running=1)
    await service.tick()
    assert w1.maintenance == "llmq: draining"

    # w1 finished: a last draining beat with nothing running, then silence → deregistered
    # as soon as it is stale (it exited on purpose), w2 only after gone_after_s.
    beat(service, clock, "w1", 5, draining=True, running=0, waiting=0)
    await service.tick()
    clock.now += 4
    await service.tick()
    assert "w1" not in registry.instances
    assert "w2" in registry.instances
    clock.now += 60
    await service.tick()
    assert "w2" not in registry.instances
    assert set(registry.instances) == {service.own_id}


async def test_drain_command_sets_maintenance_before_the_worker_reacts(
    service: HealthService, registry: InMemoryRegistry, clock: Clock
) -> None:
    beat(service, clock, "w1", 1)
    service.heartbeats_caught_up.set()
    await service.tick()
    service.tracker.observe_drain(DrainWorker(worker_id="w1", reason="kernel upgrade",
                                              issued_by="cli", issued_at=clock.now))
    await service.tick()
    assert registry.instances["w1"].maintenance == "llmq: drain requested: kernel upgrade"


async def test_tombstone_deregisters(
    service: HealthService, registry: InMemoryRegistry, clock: Clock
) -> None:
    beat(service, clock, "w1", 1)
    service.heartbeats_caught_up.set()
    await service.tick()
    service.tracker.observe_tombstone("w1")
    await service.tick()
    assert "w1" not in registry.instances


async def test_leftovers_of_an_earlier_run_are_cleaned_up(
    service: HealthService, registry: InMemoryRegistry, clock: Clock
) -> None:
    registry.register(ServiceRegistration(WORKER_SERVICE, "w-old"))
    registry.register(ServiceRegistration(WORKER_SERVICE, "w1"))
    registry.set_maintenance("w1", "left over")
    beat(service, clock, "w1", 1)
    service.heartbeats_caught_up.set()
    await service.tick()
    assert "w-old" not in registry.instances
    assert registry.instances["w1"].maintenance is None  # unknown state → set explicitly
    assert registry.instances["w1"].check == "passing"


async def test_registry_failures_are_retried_from_scratch(
    service: HealthService, registry: InMemoryRegistry, clock: Clock
) -> None:
    beat(service, clock, "w1", 1)
    service.heartbeats_caught_up.set()
    registry.fail_next = 1  # the startup listing fails: nothing else is tried this tick
    await service.tick()
    assert registry.instances == {}
    await service.tick()
    assert registry.instances["w1"].check == "passing"

    # The agent restarts and forgets everything: the next pass fails (unknown check), and
    # the tick after registers again.
    registry.forget()
    clock.now += 1
    beat(service, clock, "w1", 2)
    await service.tick()
    assert "w1" not in registry.instances
    await service.tick()
    assert registry.instances["w1"].check == "passing"
    errors = service.metrics.registry.get_sample_value("llmq_health_registry_errors_total")
    assert errors is not None and errors >= 2


async def test_not_ready_marks_own_check_critical(
    service: HealthService, registry: InMemoryRegistry
) -> None:
    service.heartbeats_caught_up.set()
    service.kafka_ok = False
    await service.tick()
    own = registry.instances[service.own_id]
    assert own.check == "critical" and "not ready" in own.note
    assert own.registration.address == "127.0.0.1"
    assert own.registration.port == 18999


async def test_runs_without_a_registry(clock: Clock) -> None:
    svc = HealthService(Settings(topic_prefix="unit"), HealthSettings(), clock=clock)
    beat(svc, clock, "w1", 1, kv_total_tokens=1000, kv_free_tokens=250, running=7)
    svc.heartbeats_caught_up.set()
    svc.kafka_ok = True
    await svc.tick()
    assert svc.ready()
    reg = svc.metrics.registry
    assert reg.get_sample_value("llmq_health_workers", {"state": "up"}) == 1.0
    assert reg.get_sample_value("llmq_health_workers", {"state": "stale"}) == 0.0
    labels = {"worker_id": "w1", "model": "meta-llama/Llama-3.1-8B-Instruct", "pool": "any",
              "state": "up"}
    assert reg.get_sample_value("llmq_health_worker_kv_utilisation", labels) == 0.75
    assert reg.get_sample_value("llmq_health_worker_running", labels) == 7.0
    assert reg.get_sample_value("llmq_health_ready") == 1.0
    assert "llmq_health_worker_waiting" in generate_latest(reg).decode()


async def test_gone_workers_leave_the_per_worker_gauges(clock: Clock) -> None:
    svc = HealthService(Settings(topic_prefix="unit"), HealthSettings(), clock=clock)
    beat(svc, clock, "w1", 1)
    await svc.tick()
    svc.tracker.observe_tombstone("w1")
    await svc.tick()
    reg = svc.metrics.registry
    assert reg.get_sample_value("llmq_health_workers", {"state": "gone"}) == 1.0
    assert 'worker_id="w1"' not in generate_latest(reg).decode()


async def test_a_worker_beating_a_slot_the_assignments_topic_lacks_fails_its_check(
    service: HealthService, registry: InMemoryRegistry, clock: Clock
) -> None:
    """Once a lag round has counted the topic's partitions (4 here), a worker on slot 6 is
    registered critical with why; before that (slots unknown) it passed, as before."""
    beat(service, clock, "w-ok", 1, partition=2)
    beat(service, clock, "w-stray", 1, partition=6)
    service.heartbeats_caught_up.set()
    await service.tick()
    assert registry.instances["w-stray"].check == "passing"
    service.slots = 4
    clock.now += 1
    beat(service, clock, "w-stray", 2, partition=6)
    await service.tick()
    assert registry.instances["w-ok"].check == "passing"
    stray = registry.instances["w-stray"]
    assert stray.check == "critical" and "slot 6 is not a partition" in stray.note


async def test_an_agent_that_forgot_its_instances_gets_them_again(
    service: HealthService, registry: InMemoryRegistry, clock: Clock
) -> None:
    """Found by an audit: after a Consul agent restart, instances whose check is critical
    (a stale worker; the service itself while not ready) were never registered again: a
    critical check is sent only when it changes, so no call failed to tell. The registry
    is listed again every 30 ticks."""
    beat(service, clock, "w-stale", 1)
    service.heartbeats_caught_up.set()
    service.kafka_ok = False  # not ready: its own check is critical
    await service.tick()
    clock.now += 5  # w-stale's window (3 s) is over: critical
    await service.tick()
    assert registry.instances["w-stale"].check == "critical"
    registry.forget()  # the agent restarted
    for _ in range(31):
        clock.now += 1
        await service.tick()
    assert registry.instances["w-stale"].check == "critical"
    assert registry.instances[service.own_id].check == "critical"
