"""FAULT INJECTION (test-only) of a dead Kafka producer in a real service process."""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent


def env(trigger: Path) -> dict[str, str]:
    """Environment for a child process whose Kafka producers' sender task dies once
    ``trigger`` exists (see ``sitecustomize.py`` here)."""
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "LLMQ_TEST_SENDER_FAULT": str(trigger)}
