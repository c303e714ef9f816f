"""The py-consul adapter against a real Consul agent (``consul agent -dev``, 127.0.0.1 only).

No Consul server can be installed on the project's build machines, so without a ``consul``
binary on PATH every test here is skipped with that reason; where one exists, these tests
are the adapter's proof. (tests/unit/test_health_consul_adapter.py checks the HTTP calls
against a recording stub everywhere.)
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import consul
import pytest

from services.common.settings import Settings
from services.health.consul_registry import ConsulRegistry, check_id
from services.health.core import WORKER_SERVICE
from services.health.registry import RegistryError, ServiceRegistration
from services.health.service import HealthService
from services.health.settings import ConsulAddress, HealthSettings
from tests.fakes.heartbeat_worker import heartbeat
from tests.fakes.ports import free_port

CONSUL = shutil.which("consul")

pytestmark = [
    pytest.mark.skipif(CONSUL is None, reason="no `consul` binary on PATH"),
    pytest.mark.timeout(60),
]


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[ConsulAddress]:
    assert CONSUL is not None
    http = free_port()
    log = (tmp_path / "consul.log").open("wb")
    proc = subprocess.Popen(
        [CONSUL, "agent", "-dev", "-bind", "127.0.0.1", "-client", "127.0.0.1",
         "-http-port", str(http), "-dns-port", "-1", "-grpc-port", "-1",
         "-server-port", str(free_port()), "-serf-lan-port", str(free_port()),
         "-serf-wan-port", str(free_port())],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    client = consul.Consul(host="127.0.0.1", port=http)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (tmp_path / "consul.log").read_text()
            try:
                if client.status.leader():
                    break
            except Exception:  # not listening yet
                pass
            assert time.monotonic() < deadline, "consul agent did not elect a leader"
            time.sleep(0.2)
        yield ConsulAddress("127.0.0.1", http)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def checks(addr: ConsulAddress) -> dict[str, Any]:
    result: dict[str, Any] = consul.Consul(host=addr.host, port=addr.port).agent.checks()
    return result


def test_register_check_maintenance_deregister(agent: ConsulAddress) -> None:
    reg = ConsulRegistry(agent)
    reg.register(ServiceRegistration(WORKER_SERVICE, "w1", tags=("pool:short",),
                                     meta=(("slot", "3"),), ttl_s=10.0))
    assert reg.service_ids(WORKER_SERVICE) == {"w1"}
    assert checks(agent)[check_id("w1")]["Status"] == "critical"  # TTL checks start critical
    reg.set_check("w1", "passing", "beat 1")
    c = checks(agent)[check_id("w1")]
    assert (c["Status"], c["Output"]) == ("passing", "beat 1")
    reg.set_check("w1", "critical", "stale")
    assert checks(agent)[check_id("w1")]["Status"] == "critical"
    reg.set_maintenance("w1", "llmq: draining")
    maint = [c for c in checks(agent).values() if c["CheckID"].startswith("_service_maint")]
    assert len(maint) == 1 and "llmq: draining" in maint[0]["Notes"]
    reg.set_maintenance("w1", None)
    assert not [c for c in checks(agent) if c.startswith("_service_maint")]
    reg.deregister("w1")
    assert reg.service_ids(WORKER_SERVICE) == set()
    reg.deregister("w1")  # idempotent
    with pytest.raises(RegistryError):
        reg.set_check("w1", "passing", "gone")


def test_ttl_expires_without_a_pass(agent: ConsulAddress) -> None:
    reg = ConsulRegistry(agent)
    reg.register(ServiceRegistration(WORKER_SERVICE, "w2", ttl_s=1.0))
    reg.set_check("w2", "passing", "once")
    assert checks(agent)[check_id("w2")]["Status"] == "passing"
    time.sleep(2.5)
    assert checks(agent)[check_id("w2")]["Status"] == "critical"


async def test_health_service_mirrors_the_fleet(agent: ConsulAddress) -> None:
    now = [time.time()]
    hs = HealthSettings(consul_addr=f"{agent.host}:{agent.port}", instance_id="it")
    svc = HealthService(Settings(topic_prefix="consul-it"), hs,
                        registry=ConsulRegistry(agent), clock=lambda: now[0])
    svc.kafka_ok = True
    svc.heartbeats_caught_up.set()
    svc.tracker.observe_heartbeat(heartbeat("w-a", ts=now[0], seq=1))
    svc.tracker.observe_heartbeat(heartbeat("w-b", ts=now[0], seq=1, draining=True))
    await svc.tick()
    found = checks(agent)
    assert found[check_id("w-a")]["Status"] == "passing"
    assert any(c.startswith("_service_maint") and "w-b" in c for c in found)
    svc.tracker.observe_tombstone("w-a")
    await svc.tick()
    assert ConsulRegistry(agent).service_ids(WORKER_SERVICE) == {"w-b"}
