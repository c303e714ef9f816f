"""FAULT INJECTION (test-only) of a dead Kafka producer in a real service process."""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent


def env(trigger: Path, code: int | None = None, topic_part: str = "") -> dict[str, str]:
    """Environment for a child process whose produce requests are answered with an error
    once ``trigger`` exists (see ``sitecustomize.py`` here): ``code`` (default 45,
    out-of-order sequence), for the topics whose name contains ``topic_part``."""
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    out = {"PYTHONPATH": path, "LLMQ_TEST_SENDER_FAULT": str(trigger),
           "LLMQ_TEST_SENDER_FAULT_TOPIC": topic_part}
    if code is not None:
        out["LLMQ_TEST_SENDER_FAULT_CODE"] = str(code)
    return out
