"""The dev tools' background-process helpers, on a real child process (``sleep``)."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

from services.dev import process
from services.dev.kafka_broker import new_cluster_id


def test_start_find_by_pid_file_and_stop(tmp_path: Path) -> None:
    marker = "llmq-dev-process-test"
    cmd = [sys.executable, "-c", "import time, sys; time.sleep(60)", marker]
    proc = process.start_detached(cmd, tmp_path / "child.log", tmp_path)
    pid_file = tmp_path / "child.pid"
    pid_file.write_text(f"{proc.pid}\n")
    try:
        assert process.alive(proc.pid)
        deadline = time.monotonic() + 30
        # Until the child has exec'd, /proc shows the parent's command line (a busy machine
        # makes that window long enough to see).
        while process.own_pid(pid_file, (marker, "time.sleep")) is None:
            assert time.monotonic() < deadline, "the child never ran its command"
            time.sleep(0.02)
        assert process.own_pid(pid_file, (marker, "time.sleep")) == proc.pid
        # Another program's command line (a reused PID) is not ours.
        assert process.own_pid(pid_file, (marker, "kafka.Kafka")) is None
    finally:
        process.stop(proc.pid, timeout_s=5.0, started=proc)
    assert proc.returncode is not None  # reaped: no zombie left
    assert not process.alive(proc.pid)
    assert process.own_pid(pid_file, (marker,)) is None
    process.stop(proc.pid, timeout_s=0.1)  # already gone: not an error


def test_sigkill_after_the_timeout(tmp_path: Path) -> None:
    ignore_term = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
        "print('ready', flush=True); time.sleep(60)"
    log = tmp_path / "child.log"
    proc = process.start_detached([sys.executable, "-c", ignore_term], log, tmp_path)
    deadline = time.monotonic() + 30
    while "ready" not in log.read_text():  # SIGTERM is ignored only once the handler is set
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    process.stop(proc.pid, timeout_s=0.3, started=proc)
    assert proc.returncode == -9


def test_missing_or_garbled_pid_file(tmp_path: Path) -> None:
    assert process.own_pid(tmp_path / "none.pid", ("x",)) is None
    (tmp_path / "bad.pid").write_text("not a pid\n")
    assert process.own_pid(tmp_path / "bad.pid", ("x",)) is None


def test_port_taken() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert process.port_taken("127.0.0.1", port)
    assert not process.port_taken("127.0.0.1", port)


def test_a_start_that_never_gets_ready_is_stopped(tmp_path: Path) -> None:
    proc = process.start_detached([sys.executable, "-c", "import time; time.sleep(60)"],
                                  tmp_path / "child.log", tmp_path)
    pid_file = tmp_path / "child.pid"
    pid_file.write_text(f"{proc.pid}\n")
    try:
        with process.stopped_on_failure(proc, pid_file, 5.0):
            outcome = process.wait_ready(proc, lambda: True, lambda: False, 0.3, 0.05)
            assert outcome == "timeout"
            raise RuntimeError("did not answer")
    except RuntimeError:
        pass
    assert proc.returncode is not None and not pid_file.exists()


def test_a_cluster_id_never_starts_with_a_dash() -> None:
    """URL-safe base64 of random bytes starts with "-" one time in 64; the storage tool then
    reads the id as an option ("argument --cluster-id/-t: expected one argument") and the
    broker never starts (seen in CI)."""
    draws = iter([b"\xf8" + bytes(15), b"\x00" * 16])  # the first encodes to "-AAA..."
    assert new_cluster_id(lambda: next(draws)) == "A" * 22
    assert all(not new_cluster_id().startswith("-") for _ in range(2_000))
