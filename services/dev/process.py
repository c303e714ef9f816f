"""Background processes of the dev tools (the embedded broker, Jaeger), by PID file.

Each tool starts its program detached (a new session, so it outlives the CLI), writes the
PID to a file and later finds it again only if that PID still runs *its* command line (a
PID reused by another program is not ours) and is not a zombie. Stopping is SIGTERM, then
SIGKILL after a timeout, then reaping the child when this process started it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal


def alive(pid: int) -> bool:
    """The process runs (exists, and is not a zombie waiting to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0) until reaped; read its state.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def own_pid(pid_file: Path, markers: Sequence[str]) -> int | None:
    """The PID in ``pid_file`` if that process is alive and its command line contains
    every one of ``markers``; else None."""
    try:
        pid = int(pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except (OSError, ValueError):
        return None
    if all(m.encode() in cmdline for m in markers) and alive(pid):
        return pid
    return None


def port_taken(host: str, port: int) -> bool:
    """Something accepts TCP connections on ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def start_detached(cmd: Sequence[str], log_file: Path, cwd: Path) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own session, output appended to ``log_file``."""
    with log_file.open("ab") as log:
        return subprocess.Popen(
            list(cmd),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # survives the CLI; stopped by `down` through the pid
            cwd=cwd,
        )


def wait_ready(
    started: subprocess.Popen[bytes] | None, running: Callable[[], bool],
    ready: Callable[[], bool], timeout_s: float, poll_s: float,
) -> Literal["ready", "exited", "timeout"]:
    """Poll ``ready`` until it answers. A process this program ``started`` is judged alive
    by ``poll()`` (right after the fork it may not have exec'd its command line yet); one
    found running, by ``running`` (its pid file)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        exited = started.poll() is not None if started is not None else not running()
        if exited:
            return "exited"
        if ready():
            return "ready"
        time.sleep(poll_s)
    return "timeout"


@contextlib.contextmanager
def stopped_on_failure(
    started: subprocess.Popen[bytes] | None, pid_file: Path, timeout_s: float
) -> Iterator[None]:
    """If the block fails, stop the process this program ``started`` (None: it found one
    running, which it leaves alone) and forget its pid file: nothing half-started stays."""
    try:
        yield
    except BaseException:
        if started is not None:
            stop(started.pid, timeout_s, started)
            pid_file.unlink(missing_ok=True)
        raise


def stop(pid: int, timeout_s: float, started: subprocess.Popen[bytes] | None = None) -> None:
    """SIGTERM ``pid``, SIGKILL it after ``timeout_s``; reap ``started`` (its Popen, when
    this process started it) so no zombie is left behind."""
    send(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive(pid):
        time.sleep(0.1)
    if alive(pid):
        send(pid, signal.SIGKILL)
        while alive(pid):
            time.sleep(0.1)
    if started is not None:
        started.wait()


def send(pid: int, sig: signal.Signals) -> None:
    """``kill(pid, sig)``; a process that already exited is not an error."""
    with contextlib.suppress(ProcessLookupError):  # it exited on its own meanwhile
        os.kill(pid, sig)


def _raise_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """While a build tool runs in a session of its own (so that it can be killed as a
    group), make SIGTERM and SIGHUP raise SystemExit here, as `llmq up` does, where they
    are still at their default (which kills this process outright): the caller's clean-up
    then stops the tool. `timeout`, a CI cancel or a closed terminal signal this process's
    group, which no longer holds the tool. A no-op off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            previous[sig] = signal.signal(sig, _raise_exit)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
