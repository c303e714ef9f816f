"""``llmq up`` stops what it started however it ends, and will not start a second stack
over a running one. The broker and Jaeger are stand-ins (their starts and stops are
recorded); nothing listens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import services.cli as cli
from services.common.settings import Settings
from services.dev import process
from services.dev.jaeger import Jaeger, JaegerStatus
from services.dev.kafka_broker import BrokerStatus, KafkaBroker
from services.stack import stack_dir


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the broker's and Jaeger's ups and downs; neither runs before ``up``."""
    made: list[str] = []
    stopped = BrokerStatus(False, False, None, "127.0.0.1:1", "d", "l")
    running = BrokerStatus(True, True, 1, "127.0.0.1:1", "d", "l")
    monkeypatch.setattr(KafkaBroker, "status", lambda self: stopped)
    monkeypatch.setattr(KafkaBroker, "up",
                        lambda self, *a, **k: (made.append("kafka up"), running)[1])
    monkeypatch.setattr(KafkaBroker, "down",
                        lambda self, *a, **k: (made.append("kafka down"), True)[1])
    monkeypatch.setattr(Jaeger, "status",
                        lambda self: JaegerStatus(False, False, None, False, "b", "l"))
    monkeypatch.setattr(Jaeger, "down", lambda self, *a, **k: made.append("jaeger down"))
    return made


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLMQ_HOME", str(tmp_path))
    monkeypatch.setenv("LLMQ_KAFKA_PORT", "1")
    return tmp_path


@pytest.mark.parametrize("ending", ["ctrl-c", "sigterm"])
def test_a_start_cut_short_stops_the_broker_it_started(
    calls: list[str], home: Path, monkeypatch: pytest.MonkeyPatch, ending: str,
) -> None:
    # Jaeger's first start builds it with Go (minutes): Ctrl-C or `timeout make up` then
    # left the broker this run had started running, holding its ports.
    def jaeger_up(self: Jaeger, *args: object, **kwargs: object) -> None:
        calls.append("jaeger up")
        if ending == "ctrl-c":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)  # its default action killed llmq outright

    monkeypatch.setattr(Jaeger, "up", jaeger_up)
    before = signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(cli.main, ["up", "--jaeger"])
    assert calls == ["kafka up", "jaeger up", "kafka down"]
    assert result.exit_code != 0
    assert signal.getsignal(signal.SIGTERM) is before  # handlers are given back


@pytest.fixture
def first_stack(home: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A detached stack's one service, recorded as `llmq up --detach` records it."""
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    proc = subprocess.Popen(argv)
    deadline = time.monotonic() + 10
    while not Path(f"/proc/{proc.pid}/cmdline").read_bytes():  # empty for a moment after exec
        assert time.monotonic() < deadline
        time.sleep(0.01)
    path = stack_dir(Settings(home=home)) / "services.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"ingest": {"pid": proc.pid, "argv": argv}}))
    yield proc
    proc.kill()
    proc.wait()


def test_a_second_stack_is_refused_while_one_runs(
    calls: list[str], home: Path, first_stack: subprocess.Popen[bytes],
) -> None:
    # It used to start anyway, fail on the taken ports and delete the first stack's
    # services.json on its way out: `llmq down` then stopped nothing.
    result = CliRunner().invoke(cli.main, ["up", "--detach"])
    assert result.exit_code == 1 and "already running" in result.output
    assert calls == []  # nothing started, the first stack's record kept
    assert (stack_dir(Settings(home=home)) / "services.json").exists()
    assert first_stack.poll() is None


def test_a_detached_start_that_fails_stops_the_broker_it_started(
    calls: list[str], home: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by an audit: the error said "everything started was stopped", but the broker
    this run had started kept running (the foreground path stopped it)."""
    import services.stack as stack

    async def no_topics(settings: Settings) -> list[str]:
        return []

    monkeypatch.setattr(cli, "create_catalog_topics", no_topics)
    monkeypatch.setattr(cli, "_DETACH_SETTLE_S", 0.5)
    monkeypatch.setattr(stack, "stack_services", lambda cfg: [
        stack.ServiceSpec("scheduler", (sys.executable, "-c", "raise SystemExit(3)"))])
    result = CliRunner().invoke(cli.main, ["up", "--detach"])
    assert result.exit_code != 0 and "exited with status 3" in result.output
    assert calls == ["kafka up", "kafka down"]


@pytest.mark.parametrize("cut", ["sigterm", "services.json unwritable"])
def test_a_detached_start_cut_short_after_its_children_started_stops_them(
    calls: list[str], home: Path, monkeypatch: pytest.MonkeyPatch, cut: str,
) -> None:
    """Found by a review: a SIGTERM while a detached start waited to see its children
    settle (a closed terminal, `timeout make up`), or services.json failing to be written,
    stopped the broker and left the children running, without a broker (and, in the
    second case, unknown to `llmq down`)."""
    import services.stack as stack

    async def no_topics(settings: Settings) -> list[str]:
        return []

    started: list[int] = []
    real_start = stack.Stack.start

    def start(self: stack.Stack, log_dir: Path | None = None) -> None:
        real_start(self, log_dir)
        started.extend(p.pid for _, p in self.procs)

    monkeypatch.setattr(stack.Stack, "start", start)
    monkeypatch.setattr(cli, "create_catalog_topics", no_topics)
    monkeypatch.setattr(stack, "stack_services", lambda cfg: [
        stack.ServiceSpec("scheduler", (sys.executable, "-c", "import time; time.sleep(60)"))])
    if cut == "sigterm":
        monkeypatch.setattr(cli, "_DETACH_SETTLE_S", 30.0)
        real_sleep = time.sleep

        def sleep(seconds: float) -> None:
            if seconds == 30.0:
                os.kill(os.getpid(), signal.SIGTERM)
            real_sleep(0.05)

        monkeypatch.setattr(cli.time, "sleep", sleep)
    else:
        def unwritable(*args: object) -> Path:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(stack, "write_services_file", unwritable)
    result = CliRunner().invoke(cli.main, ["up", "--detach"])
    assert result.exit_code != 0
    assert calls == ["kafka up", "kafka down"]
    (pid,) = started
    left = process.alive(pid)
    if left:
        os.kill(pid, signal.SIGKILL)  # not left behind by a failing run
    assert not left  # stopped (and reaped) before the command ended
    assert not (stack_dir(Settings(home=home)) / "services.json").exists()


def test_the_childrens_environment_does_not_override_what_the_stack_gives_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """LLMQ_INGEST_HTTP_PORT in the caller's environment won over --http-port (ingest reads
    it first), and LLMQ_WORKER_WORKER_ID gave every worker one id. Found by a review since:
    LLMQ_WORKER_ROLE made every mixed worker (given no --role) a prefill worker, and
    LLMQ_SCHEDULER_REPLICAS / _REPLICA_INDEX gave every replica the same turn."""
    import services.stack as stack

    monkeypatch.setenv("LLMQ_INGEST_HTTP_PORT", "8081")
    monkeypatch.setenv("LLMQ_WORKER_WORKER_ID", "w-same")
    monkeypatch.setenv("LLMQ_WORKER_ROLE", "prefill")
    monkeypatch.setenv("LLMQ_SCHEDULER_REPLICAS", "1")
    monkeypatch.setenv("LLMQ_SCHEDULER_REPLICA_INDEX", "0")
    seen: dict[str, dict[str, str]] = {}
    argvs: dict[str, list[str]] = {}

    class Recorded:
        def __init__(self, argv: Any, env: dict[str, str], **kwargs: Any) -> None:
            seen[argv[2]] = env
            argvs[argv[2]] = list(argv)
            self.stdout = None

        def poll(self) -> int:
            return 0

    monkeypatch.setattr(stack.subprocess, "Popen", Recorded)
    specs = stack.stack_services(stack.StackConfig(http_port=8080, schedulers=2))
    stack.Stack([s for s in specs if s.name in ("ingest", "worker-0", "scheduler-2")],
                {}).start(log_dir=tmp_path)
    assert seen["services.ingest"]["LLMQ_INGEST_HTTP_PORT"] == "8080"
    assert "LLMQ_WORKER_WORKER_ID" not in seen["services.worker"]
    worker = argvs["services.worker"]
    assert worker[worker.index("--role") + 1] == "mixed"  # an option wins over the env
    assert not {"LLMQ_SCHEDULER_REPLICAS", "LLMQ_SCHEDULER_REPLICA_INDEX"} \
        & set(seen["services.scheduler"])
