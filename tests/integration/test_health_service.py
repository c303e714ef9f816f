"""``python -m services.health`` as a real process: endpoints on 127.0.0.1 only, no Consul.

The service runs against the real broker with a unique topic prefix; a FAKE worker
(tests/fakes/heartbeat_worker.py) heartbeats so /status and the metrics have something to
show. Nothing here needs Consul: without LLMQ_CONSUL_ADDR the service must run fully.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fakes.heartbeat_worker import FakeHeartbeatWorker
from tests.fakes.ports import free_port, listening_sockets

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of the LISTEN sockets owned by ``pid``."""
    return {(_ip(addr), port) for addr, port in listening_sockets(pid)}


def _ip(hex_addr: str) -> str:
    if len(hex_addr) == 8:  # IPv4, little-endian
        return socket.inet_ntop(socket.AF_INET, bytes.fromhex(hex_addr)[::-1])
    return hex_addr  # IPv6: any such socket fails the assertion below, which is the point


class HealthProcess:
    def __init__(self, bootstrap: str, prefix: str, home: Path, port: int,
                 metrics_port: int) -> None:
        self.port, self.metrics_port = port, metrics_port
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
        env.update({"LLMQ_KAFKA_BOOTSTRAP": bootstrap, "LLMQ_TOPIC_PREFIX": prefix,
                    "LLMQ_HOME": str(home), "LLMQ_ASSIGNMENT_PARTITIONS": "2",
                    "LLMQ_HEALTH_PORT": str(port),
                    "LLMQ_METRICS_PORT": str(metrics_port), "PYTHONUNBUFFERED": "1"})
        self.log = home / "health.log"
        self._out = self.log.open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "services.health"], env=env,
                                     stdout=self._out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._out.close()
        return code

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@pytest.fixture
def health(bootstrap: str, topic_prefix: str, tmp_path: Path) -> Iterator[HealthProcess]:
    proc = HealthProcess(bootstrap, topic_prefix, tmp_path, free_port(), free_port())
    yield proc
    proc.stop()


async def _wait_ready(client: httpx.AsyncClient, proc: HealthProcess, url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.proc.poll() is None, proc.tail()
        try:
            if (await client.get(url)).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"{url} never answered 200:\n{proc.tail()}")


async def test_serves_probes_and_status_on_loopback_without_consul(
    health: HealthProcess, bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    port, metrics_port = health.port, health.metrics_port
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(timeout=5.0) as client:
        await _wait_ready(client, health, f"{base}/healthz")
        await _wait_ready(client, health, f"{base}/readyz")
        ready = (await client.get(f"{base}/readyz")).json()
        assert ready == {"ready": True, "kafka": True, "kafka_error": None,
                         "heartbeats_caught_up": True, "consul": False}

        # Bound to 127.0.0.1 only: both listening sockets, and nothing else.
        listening = _listening(health.proc.pid)
        assert listening == {("127.0.0.1", port), ("127.0.0.1", metrics_port)}, listening

        worker = FakeHeartbeatWorker(bootstrap, topic_prefix, "w-live", slot=1,
                                     interval_s=0.3, running=2)
        await worker.start()
        try:
            deadline = time.monotonic() + 45
            while True:
                doc = (await client.get(f"{base}/status")).json()
                if doc["workers"]:
                    break
                assert time.monotonic() < deadline, health.tail()
                await asyncio.sleep(0.3)
            assert set(doc) >= {"workers", "topics", "metrics_urls"}
            (row,) = doc["workers"]
            assert (row["worker_id"], row["state"], row["slot"], row["running"]) == (
                "w-live", "up", 1, 2)
            assert {t["topic"] for t in doc["topics"]} >= {f"{topic_prefix}.heartbeats"}
            assert doc["metrics_urls"] == {}
            assert doc["warnings"] == []

            # A worker beating slot 5 of the topic's 2: the schedulers refuse it, and the
            # status the health service serves says so.
            stray = FakeHeartbeatWorker(bootstrap, topic_prefix, "w-stray", slot=5,
                                        interval_s=0.3)
            await stray.start()
            try:
                while len((doc := (await client.get(f"{base}/status")).json())["workers"]) < 2:
                    assert time.monotonic() < deadline, health.tail()
                    await asyncio.sleep(0.3)
            finally:
                await stray.stop()
            (warning,) = doc["warnings"]
            assert "slot 5 is not a partition of the assignments topic (2 partitions)" in warning

            # The gauges refresh every tick (1 s): wait for the one that saw the worker.
            metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            while 'llmq_health_workers{state="up"} 1.0' not in (
                metrics := (await client.get(metrics_url)).text
            ):
                assert time.monotonic() < deadline, metrics
                await asyncio.sleep(0.3)
            assert 'worker_id="w-live"' in metrics
            assert "llmq_health_ready 1.0" in metrics
        finally:
            await worker.stop()
    assert health.stop() == 0, health.tail()


def test_bad_configuration_exits_2(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
    env["LLMQ_CONSUL_ADDR"] = "ftp://nowhere"
    done = subprocess.run([sys.executable, "-m", "services.health"], env=env,
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2
    assert "invalid configuration" in done.stderr


def test_port_in_use_exits_2() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
        env["LLMQ_HEALTH_PORT"] = str(port)
        done = subprocess.run([sys.executable, "-m", "services.health"], env=env,
                              capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


async def test_kafka_down_is_alive_but_not_ready(topic_prefix: str, tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"  # nothing listens once closed
    proc = HealthProcess(dead, topic_prefix, tmp_path, free_port(), free_port())
    base = f"http://127.0.0.1:{proc.port}"
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            await _wait_ready(client, proc, f"{base}/healthz")
            deadline = time.monotonic() + 45
            while (ready := await client.get(f"{base}/readyz")).json()["kafka_error"] == (
                    "not probed yet"):
                assert time.monotonic() < deadline, proc.tail()
                await asyncio.sleep(0.2)
            assert ready.status_code == 503
            assert ready.json()["ready"] is False and ready.json()["kafka"] is False
            status = await client.get(f"{base}/status")
            assert status.status_code == 503 and "error" in status.json()
    finally:
        assert proc.stop() == 0, proc.tail()
