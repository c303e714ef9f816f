"""`llmq dev jaeger`: the real Jaeger binary started, checked and stopped by PID.

Uses the project's cached binary (built once if missing; skipped when it cannot be built).
Jaeger's ports are fixed (infra/jaeger/config.yaml), so a Jaeger that already runs (from
`make up`) is stopped for the test and started again at its end.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from services.common.settings import Settings
from services.dev.jaeger import PORTS, Jaeger, JaegerError, jaeger, query_answers

pytestmark = [pytest.mark.slow]


def _listeners(pid: int) -> set[str]:
    """Local addresses of the TCP/UDP sockets ``pid`` listens on (``ss -ltunp``)."""
    out = subprocess.run(["ss", "-H", "-ltunp"], capture_output=True, text=True,
                         check=True).stdout
    return {line.split()[4] for line in out.splitlines() if f"pid={pid}," in line}


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs `ss` (iproute2)")
def test_up_status_down_and_nothing_beyond_loopback(tmp_path: Path) -> None:
    local = Jaeger.from_settings(Settings())
    was_running = local.status().running
    if query_answers() and not was_running:
        pytest.skip("another program answers on Jaeger's query port")
    try:
        local.build(echo=lambda _: None)
    except JaegerError as exc:
        pytest.skip(f"Jaeger cannot be built here: {exc}")
    runner = CliRunner()
    try:
        local.down()
        down = runner.invoke(jaeger, ["status", "--json"], obj=Settings())
        assert down.exit_code == 1 and json.loads(down.stdout)["running"] is False

        up = runner.invoke(jaeger, ["up", "--json"], obj=Settings())
        assert up.exit_code == 0, up.output
        status = json.loads(up.stdout)  # progress lines go to stderr
        assert status["answering"] and status["otlp_http_traces"].startswith("http://127.0.0.1:")
        again = runner.invoke(jaeger, ["up", "--json"], obj=Settings())  # idempotent
        assert json.loads(again.stdout)["pid"] == status["pid"]

        listening = _listeners(status["pid"])
        assert listening, "Jaeger listens on nothing?"
        assert all(re.fullmatch(r"127\.0\.0\.1:\d+", a) for a in listening), listening
        assert {int(a.rsplit(":", 1)[1]) for a in listening} == set(PORTS.values())

        stopped = runner.invoke(jaeger, ["down", "--json"], obj=Settings())
        assert json.loads(stopped.stdout) == {"stopped": True}
        assert not query_answers()
        twice = runner.invoke(jaeger, ["down", "--json"], obj=Settings())
        assert json.loads(twice.stdout) == {"stopped": False}
    finally:
        if was_running:
            local.up()
        else:
            local.down()
