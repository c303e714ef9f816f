"""``scripts/bench/replica_placement.py`` end to end, small: it runs (real broker, real
scheduler processes, FAKE workers), writes its JSON, and its burst places nothing past a
worker's KV. Its figures are not asserted (benchmarks, not timed tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_replica_benchmark_runs_and_reports(tmp_path: Path, bootstrap: str) -> None:
    out = tmp_path / "replicas.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench" / "replica_placement.py"),
         "--replicas", "2", "--requests", "6", "--interval-s", "0.05", "--burst", "9",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=220, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())["replicas"]["2"]
    assert figures["steady"]["requests"] == 6
    assert 0 <= figures["steady"]["p50_ms"] <= figures["steady"]["p99_ms"]
    assert figures["burst"] == {**figures["burst"], "requests": 9, "past_usable_kv": 0}
    assert "2 replica(s): admission to placement p50" in done.stdout


def test_it_refuses_a_bad_setting() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench" / "replica_placement.py"),
         "--set", "TURN_SLOT_S=1"], cwd=ROOT, capture_output=True, text=True, timeout=60,
        check=False)
    assert done.returncode == 2 and "--set wants LLMQ_NAME=VALUE" in done.stderr
