"""The scheduler runtime stays testable without Kafka: only ``reader`` (aiokafka),
``metrics`` (prometheus_client) and ``topics`` (services.common.kafka's TopicRequest) touch
infrastructure; the state classes import none of it, nor faust."""

from __future__ import annotations

import subprocess
import sys

import pytest

PLAIN = ["fleet", "flow", "log", "messages", "meters", "outbox", "state"]


@pytest.mark.parametrize("module", PLAIN)
def test_runtime_module_imports_no_kafka_client(module: str) -> None:
    code = (
        f"import services.scheduler.runtime.{module}, sys; "
        "print([m for m in ('faust', 'aiokafka', 'mode', 'prometheus_client') "
        "if m in sys.modules])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"{module} imports {done.stdout.strip()}"
