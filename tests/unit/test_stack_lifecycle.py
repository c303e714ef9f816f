"""The local stack's process handling (services.stack.Stack) on real child processes (small
Python scripts), no Kafka: a failed start leaves nothing running, and stop() lets the
workers drain before the services that stream their answers go."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from services.common.settings import Settings
from services.stack import (
    ServiceSpec,
    Stack,
    run_foreground,
    stack_dir,
    stop_detached,
    stop_stages,
)

#: A child that notes when it got SIGTERM, then takes ``delay`` s to exit (a drain).
_CHILD = """
import signal, sys, time
log, delay = sys.argv[1], float(sys.argv[2])
def down(*_):
    with open(log, "a") as f:
        f.write(f"{sys.argv[3]} {time.monotonic()}\\n")
    time.sleep(delay)
    sys.exit(0)
signal.signal(signal.SIGTERM, down)
open(sys.argv[4], "w").close()  # ready: the handler is set
while True:
    time.sleep(0.05)
"""


def _spec(tmp: Path, name: str, delay: float = 0.0) -> ServiceSpec:
    return ServiceSpec(name, (sys.executable, "-c", _CHILD, str(tmp / "terms.log"), str(delay),
                              name, str(tmp / f"{name}.ready")))


def _wait_ready(tmp: Path, *names: str) -> None:
    deadline = time.monotonic() + 30
    while not all((tmp / f"{n}.ready").exists() for n in names):
        assert time.monotonic() < deadline, "children did not start"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_start_that_fails_half_way_stops_what_it_started(tmp_path: Path) -> None:
    stack = Stack([_spec(tmp_path, "ingest"),
                   ServiceSpec("broken", (str(tmp_path / "no-such-program"),))], {})
    with pytest.raises(FileNotFoundError):
        stack.start()
    [(_, first)] = stack.procs
    assert first.poll() is not None  # stopped, not left running in its own session


def test_workers_are_stopped_and_drained_before_the_other_services(tmp_path: Path) -> None:
    stack = Stack([_spec(tmp_path, "ingest"), _spec(tmp_path, "scheduler"),
                   _spec(tmp_path, "worker-0", delay=1.0)], {})
    stack.start()
    _wait_ready(tmp_path, "ingest", "scheduler", "worker-0")
    stack.stop(grace_s=10.0)
    terms = dict(line.split() for line in (tmp_path / "terms.log").read_text().splitlines())
    # ingest and the scheduler got SIGTERM only once the worker had drained (1 s).
    assert float(terms["ingest"]) - float(terms["worker-0"]) >= 0.9
    assert float(terms["scheduler"]) - float(terms["worker-0"]) >= 0.9
    assert all(p.poll() is not None for _, p in stack.procs)


def test_prefill_workers_drain_before_the_decode_workers_they_hand_off_to(
        tmp_path: Path) -> None:
    prefill = _spec(tmp_path, "worker-0", delay=1.0)
    prefill = ServiceSpec(prefill.name, (*prefill.argv, "--role", "prefill"))
    stack = Stack([_spec(tmp_path, "ingest"), prefill, _spec(tmp_path, "worker-1")], {})
    stack.start()
    _wait_ready(tmp_path, "ingest", "worker-0", "worker-1")
    stack.stop(grace_s=10.0)
    terms = dict(line.split() for line in (tmp_path / "terms.log").read_text().splitlines())
    # The decode worker still ran while the prefill worker drained (1 s), then ingest went.
    assert float(terms["worker-1"]) - float(terms["worker-0"]) >= 0.9
    assert float(terms["ingest"]) >= float(terms["worker-1"])


def test_stop_stages() -> None:
    services = [("scheduler", ("py",)), ("ingest", ("py",)),
                ("worker-0", ("py", "--pool", "short")),
                ("worker-1", ("py", "--role", "prefill")),
                ("worker-2", ("py", "--role", "decode"))]
    assert stop_stages(services) == [["worker-1"], ["worker-0", "worker-2"],
                                     ["ingest", "scheduler"]]
    assert stop_stages(services[:3]) == [["worker-0"], ["ingest", "scheduler"]]


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_a_hangup_stops_the_stack_like_sigterm(tmp_path: Path, sig: int) -> None:
    stack = Stack([_spec(tmp_path, "ingest"), _spec(tmp_path, "worker-0")], {})

    def started() -> None:
        _wait_ready(tmp_path, "ingest", "worker-0")
        os.kill(os.getpid(), sig)  # as the terminal closing would

    assert run_foreground(stack, on_started=started) == 0
    assert not any(_alive(p.pid) and p.poll() is None for _, p in stack.procs)


def test_the_stop_signal_handler_takes_no_lock(tmp_path: Path) -> None:
    """The handler runs in the main thread between two bytecodes, maybe while that thread
    holds a lock of the very wait it is in: a handler that takes that lock (it called
    threading.Event.set(), whose Condition wraps a plain Lock) waits forever. `timeout …
    make up` hung that way, its children zombies. So the handler only notes the signal."""
    stack = Stack([_spec(tmp_path, "ingest")], {})
    called: list[str] = []

    def started() -> None:
        _wait_ready(tmp_path, "ingest")
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)

        def profile(frame: Any, event: str, _arg: object) -> None:
            if event in ("call", "c_call"):
                called.append(f"{frame.f_code.co_filename}:{frame.f_code.co_qualname}")

        sys.setprofile(profile)
        try:
            handler(signal.SIGTERM, None)  # as the kernel would, mid-wait
        finally:
            sys.setprofile(None)

    assert run_foreground(stack, on_started=started) == 0  # ... and it still stops
    assert not [c for c in called if "threading" in c], called


def test_llmq_down_drains_detached_workers_before_the_other_services(tmp_path: Path) -> None:
    specs = [_spec(tmp_path, "ingest"), _spec(tmp_path, "worker-0", delay=1.0)]
    procs = {s.name: subprocess.Popen(list(s.argv), start_new_session=True) for s in specs}
    try:
        _wait_ready(tmp_path, "ingest", "worker-0")
        settings = Settings(home=tmp_path / "home")
        stack_dir(settings).mkdir(parents=True)
        (stack_dir(settings) / "services.json").write_text(json.dumps(
            {s.name: {"pid": procs[s.name].pid, "argv": list(s.argv)} for s in specs}))
        assert sorted(stop_detached(settings, grace_s=10.0)) == ["ingest", "worker-0"]
        terms = dict(line.split() for line in (tmp_path / "terms.log").read_text().splitlines())
        assert float(terms["ingest"]) - float(terms["worker-0"]) >= 0.9
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_a_drained_worker_leaves_and_the_stack_runs_on(tmp_path: Path) -> None:
    # `llmq drain` makes a worker finish its work and exit 0; that used to stop the whole
    # foreground stack (and `make up` with status 1) as if it had crashed.
    drained = ServiceSpec("worker-1", (sys.executable, "-c", "import sys; sys.exit(0)"))
    stack = Stack([_spec(tmp_path, "ingest"), _spec(tmp_path, "worker-0"), drained], {})
    fired: list[float] = []

    def stop_later() -> None:
        fired.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    timer = threading.Timer(2.5, stop_later)  # worker-1 is long gone by then
    try:
        assert run_foreground(stack, on_started=timer.start) == 0
    finally:
        timer.cancel()  # the old code returned early: no stray SIGTERM for the next test
    terms = dict(line.split() for line in (tmp_path / "terms.log").read_text().splitlines())
    assert float(terms["ingest"]) >= fired[0]  # stopped by the signal, not by the drain


def test_a_worker_that_fails_still_stops_the_stack(tmp_path: Path) -> None:
    crashed = ServiceSpec("worker-1", (sys.executable, "-c", "import sys; sys.exit(3)"))
    stack = Stack([_spec(tmp_path, "ingest"), crashed], {})
    assert run_foreground(stack) == 1
    assert all(p.poll() is not None for _, p in stack.procs)
