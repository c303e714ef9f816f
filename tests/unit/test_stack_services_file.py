"""`llmq down` on a malformed <LLMQ_HOME>/stack/services.json: a bad entry is skipped with
one line naming the file and the entry, and the others are still stopped; a file that is
not a JSON object is one line naming it (exit 1), never a traceback. Real child processes,
no Kafka."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from services.cli import main
from services.common.settings import Settings
from services.stack import ServicesFileError, running_services, stack_dir, stop_detached

_SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def home(tmp_path: Path) -> Settings:
    """Settings whose LLMQ_HOME is a fresh folder (its stack/ folder made)."""
    settings = Settings(home=tmp_path / "home")
    stack_dir(settings).mkdir(parents=True)
    return settings


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(_SLEEPER, start_new_session=True)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[:-1] != [
            a.encode() for a in _SLEEPER]:  # until it has exec'd what services.json says
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.01)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _write(home: Settings, data: Any) -> Path:
    path = stack_dir(home) / "services.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.mark.parametrize("bad", [{}, 5, {"pid": "x"}, {"pid": True, "argv": []},
                                 {"pid": 0, "argv": []}, {"pid": 1234, "argv": "python"}])
def test_a_bad_entry_is_skipped_and_the_others_are_stopped(
    bad: Any, home: Settings, child: subprocess.Popen[bytes],
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = _write(home, {"bad": bad, "ingest": {"pid": child.pid, "argv": _SLEEPER}})
    assert running_services(home) == ["ingest"]
    assert stop_detached(home, grace_s=5.0) == ["ingest"]
    assert child.wait(timeout=10) is not None  # stopped
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings and all(f"ignoring entry 'bad' of {path}" in w for w in warnings)


@pytest.mark.parametrize("content", ["[1]", '"x"', "not json", "{"])
def test_a_file_that_is_not_a_json_object_stops_nothing(
    content: str, home: Settings, child: subprocess.Popen[bytes]
) -> None:
    path = _write(home, content)
    with pytest.raises(ServicesFileError, match=str(path)):
        stop_detached(home, grace_s=5.0)
    assert child.poll() is None and path.exists()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _down(home: Settings) -> Any:
    # An external bootstrap: `llmq down` leaves the (embedded) broker alone.
    env = {"LLMQ_HOME": str(home.home), "LLMQ_KAFKA_BOOTSTRAP": f"127.0.0.1:{_closed_port()}"}
    return CliRunner().invoke(main, ["down", "--keep-kafka"], env=env)


@pytest.mark.parametrize("data", [{"a": {}}, {"a": 5}, {"a": {"pid": "x"}}])
def test_llmq_down_warns_about_a_bad_entry_in_one_line(data: Any, home: Settings) -> None:
    path = _write(home, data)
    result = _down(home)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    (warning,) = [line for line in result.output.splitlines() if "warning" in line]
    assert f"ignoring entry 'a' of {path}" in warning
    assert "stopped 0 services" in result.output


def test_llmq_down_says_what_to_do_with_a_file_that_is_not_an_object(
        home: Settings) -> None:
    path = _write(home, "[1]")
    result = _down(home)
    assert result.exit_code == 1
    assert result.exception is None or isinstance(result.exception, SystemExit)
    (line,) = result.output.splitlines()
    assert str(path) in line and "not a JSON object" in line and "delete it" in line


def test_llmq_down_leaves_a_process_that_only_has_the_same_command(
    home: Settings, child: subprocess.Popen[bytes]
) -> None:
    """Found by an audit: identity was the command line alone, which every stack's service
    shares whatever its LLMQ_HOME, so a pid reused by another stack's service was stopped.
    The start time recorded with the pid tells them apart."""
    from services.stack import process_started

    started = process_started(child.pid)
    assert started is not None
    _write(home, {"ingest": {"pid": child.pid, "argv": _SLEEPER, "started": started + 1}})
    assert running_services(home) == []
    assert stop_detached(home, grace_s=1.0) == [] and child.poll() is None  # left alone
    _write(home, {"ingest": {"pid": child.pid, "argv": _SLEEPER, "started": started}})
    assert running_services(home) == ["ingest"]


def test_a_pid_reused_during_the_grace_is_not_killed(
    home: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: identity was checked once, before the SIGTERM; the SIGKILL after
    the grace went to whatever held the pid then (here: the same pid, no longer ours)."""
    import services.stack as stack

    stubborn = [sys.executable, "-c",
                "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(60)"]
    proc = subprocess.Popen(stubborn, start_new_session=True, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        _write(home, {"ingest": {"pid": proc.pid, "argv": stubborn}})
        checks = iter([True])  # ours when chosen; another process's by the end of the grace
        monkeypatch.setattr(stack, "_is_ours", lambda service: next(checks, False))
        assert stop_detached(home, grace_s=0.3) == ["ingest"]
        with pytest.raises(subprocess.TimeoutExpired):  # not killed (a SIGKILL ends it at once)
            proc.wait(timeout=1.0)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
