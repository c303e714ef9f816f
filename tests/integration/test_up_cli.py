"""`llmq up` in the foreground, as a real process on its own broker: it serves, and a stop
signal leaves no process behind — the broker it started included."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.common.settings import Settings
from services.dev.kafka_broker import BrokerConfig, KafkaBroker
from tests.fakes.ports import free_port_block
from tests.prefixes import unique_prefix

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def _open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_foreground_up_stops_everything_it_started(tmp_path: Path, settings: Settings) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "cache").symlink_to(settings.cache_dir)  # the jars the test broker already uses
    base = free_port_block(9)  # kafka, controller, http, health, 5 metrics ports
    env = {
        **os.environ, "LLMQ_HOME": str(home), "LLMQ_KAFKA_PORT": str(base),
        "LLMQ_KAFKA_CONTROLLER_PORT": str(base + 1), "LLMQ_KAFKA_HEAP_MB": "256",
        "LLMQ_TOPIC_PREFIX": unique_prefix("up"),
    }
    env.pop("LLMQ_KAFKA_BOOTSTRAP", None)
    env.pop("LLMQ_OTLP_ENDPOINT", None)
    broker = KafkaBroker(BrokerConfig.from_settings(
        Settings(home=home, kafka_port=base, kafka_controller_port=base + 1)))
    argv = [sys.executable, "-m", "services.cli", "up", "--short-workers", "1",
            "--long-workers", "1", "--http-port", str(base + 2), "--health-port", str(base + 3),
            "--metrics-base-port", str(base + 4)]
    with (tmp_path / "up.log").open("wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{base + 2}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        else:
            raise AssertionError("llmq up not ready: " + (tmp_path / "up.log").read_text()[-3000:])
        broker_pid = broker.status().pid
        assert broker_pid is not None
        proc.send_signal(signal.SIGTERM)  # what Ctrl-C does too (SIGINT is handled the same)
        assert proc.wait(timeout=90) == 0, (tmp_path / "up.log").read_text()[-3000:]
        assert not broker.status().running  # gone, or a zombie (process.alive)
        assert [p for p in range(base, base + 9) if _open(p)] == []
        assert "kafka stopped" in (tmp_path / "up.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        broker.down()
