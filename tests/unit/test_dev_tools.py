"""The local tooling around the stack, on real child processes (fake ``mvn`` and ``go``
scripts that only sleep; labelled fakes of the build tools, no download): an interrupted
`llmq up` leaves no build running, a closed output does not wedge a service, and relative
state folders work."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from services.common.settings import Settings
from services.stack import _pump

_REPO = Path(__file__).resolve().parents[2]

#: A fake build tool: writes its pid, then sleeps (a fetch or a build in progress).
_FAKE_TOOL = """#!/usr/bin/env bash
echo $$ > "{pid_file}"
exec sleep 60
"""


def test_a_relative_home_or_data_dir_is_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker and Jaeger run in their data folder: a relative path named files that
    were not there (the broker opened state/kafka/state/kafka/server.properties)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LLMQ_HOME", "state")
    monkeypatch.setenv("LLMQ_KAFKA_DATA_DIR", "~/broker")
    settings = Settings()
    assert settings.home == tmp_path / "state"
    assert settings.kafka_data_dir == Path.home() / "broker"
    assert settings.broker_data_dir.is_absolute() and settings.cache_dir.is_absolute()


class _GoneOutput(io.StringIO):
    """The supervisor's stdout after its reader left (``llmq up | head``)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_child_is_still_read_after_the_output_went_away() -> None:
    """A child whose pipe nobody reads blocks in its next write once the pipe is full,
    alive: the stack never noticed. Its output is read to the end and dropped."""
    lines = b"".join(b"line %d\n" % n for n in range(5_000))
    child_output = io.BytesIO(lines)
    _pump("worker-0", "32", child_output, _GoneOutput(), tty=False)
    assert child_output.tell() == len(lines)


def _interrupted(code: str, tool: str, tmp_path: Path, *, handler: bool = True) -> int:
    """Run ``code`` in a child Python, with a fake ``tool`` on PATH; SIGTERM it once the
    tool runs; the tool's pid. ``handler``: its SIGTERM raises SystemExit, as `llmq up`'s
    does; without, SIGTERM is at its default (`llmq dev kafka up`, `llmq dev jaeger
    build`, which scripts/test.sh runs)."""
    bin_dir, pid_file = tmp_path / "bin", tmp_path / f"{tool}.pid"
    bin_dir.mkdir()
    fake = bin_dir / tool
    fake.write_text(_FAKE_TOOL.format(pid_file=pid_file))
    fake.chmod(0o755)
    prelude = textwrap.dedent("""
        import signal
        def _exit(signum, frame): raise SystemExit(128 + signum)
        signal.signal(signal.SIGTERM, _exit)
    """)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "LLMQ_HOME": str(tmp_path / "home")}
    if not handler:
        prelude = ""
    child = subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(code)], env=env,
                             cwd=_REPO, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert child.poll() is None and time.monotonic() < deadline, "the tool never ran"
        time.sleep(0.05)
    child.send_signal(signal.SIGTERM)
    assert child.wait(10) != 0
    return int(pid_file.read_text())


def _running(pid: int) -> bool:
    for _ in range(40):  # reaped by init shortly after its kill
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state == "Z":
            return False
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)  # do not leave it behind
    return True


@pytest.mark.parametrize("handler", [True, False])
def test_an_interrupted_kafka_fetch_leaves_no_maven_running(
    tmp_path: Path, handler: bool
) -> None:
    """Killing fetch.sh alone left its mvn running; the next `llmq up` fetched into the
    same folder beside it. (Without a handler: found by a review of the first fix, which
    put mvn in a session of its own, out of reach of a signal to the caller's group.)"""
    tool = _interrupted("""
        from services.common.settings import Settings
        from services.dev.kafka_broker import BrokerConfig, KafkaBroker
        KafkaBroker(BrokerConfig.from_settings(Settings())).provision()
    """, "mvn", tmp_path, handler=handler)
    assert not _running(tool)


@pytest.mark.parametrize("handler", [True, False])
def test_an_interrupted_jaeger_build_leaves_no_go_running(
    tmp_path: Path, handler: bool
) -> None:
    tool = _interrupted("""
        from services.common.settings import Settings
        from services.dev.jaeger import Jaeger
        Jaeger.from_settings(Settings()).build(echo=lambda _: None)
    """, "go", tmp_path, handler=handler)
    assert not _running(tool)
    assert not list((tmp_path / "home").rglob("*.partial"))


def test_a_fetch_that_fails_keeps_the_jars_there_were(tmp_path: Path) -> None:
    """Found by a review: a cache fetched for an earlier pom.xml was deleted before Maven
    ran, so an offline `llmq up` after a pull could no longer start the broker."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mvn").write_text("#!/bin/sh\necho offline >&2\nexit 1\n")
    (bin_dir / "mvn").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    fetch = [str(_REPO / "infra" / "kafka" / "fetch.sh")]
    empty = subprocess.run(["bash", *fetch, str(tmp_path / "empty")], env=env,
                           capture_output=True, text=True)
    assert empty.returncode == 1 and "offline" in empty.stderr
    pom = (_REPO / "infra" / "kafka" / "pom.xml").read_text()
    version = pom.split("<kafka.version>")[1].split("<")[0]
    libs = tmp_path / "cache" / f"kafka-{version}" / "libs"
    libs.mkdir(parents=True)
    (libs / "kafka_2.13-4.1.1.jar").write_bytes(b"jar")
    (libs / ".complete").write_text("an earlier pom\n")
    kept = subprocess.run(["bash", *fetch, str(tmp_path / "cache")], env=env,
                          capture_output=True, text=True)
    assert kept.returncode == 0, kept.stderr
    assert kept.stdout.strip() == str(libs)
    assert (libs / "kafka_2.13-4.1.1.jar").read_bytes() == b"jar"
    assert "using the jars already in" in kept.stderr
    (libs / ".complete").unlink()  # a fetch interrupted before: a partial set, unmarked
    partial = subprocess.run(["bash", *fetch, str(tmp_path / "cache")], env=env,
                             capture_output=True, text=True)
    assert partial.returncode == 1
