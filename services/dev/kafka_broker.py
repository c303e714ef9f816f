"""The embedded Apache Kafka broker: fetch, format once, start, wait, stop by PID.

One KRaft node that is both broker and controller, bound to loopback only, with a small
heap and single-node settings (replication factor 1 for internal topics, no initial
rebalance delay so consumer groups form in milliseconds, not seconds). The jars come from
Maven Central through ``infra/kafka/pom.xml`` (see ``infra/kafka/fetch.sh``).

Files under the data folder: ``server.properties`` (rewritten at every start from the
settings), ``logs/`` (the broker's log dirs, formatted once), ``kafka.pid``, ``kafka.log``.
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.common.kafka import broker_answers, wait_for_group_coordinator
from services.common.settings import PROJECT_ROOT, Settings
from services.dev import process

INFRA_DIR = PROJECT_ROOT / "infra" / "kafka"


def new_cluster_id(draw: Callable[[], bytes] = lambda: uuid.uuid4().bytes) -> str:
    """A KRaft cluster id: 16 random bytes in URL-safe base64, never starting with "-"
    (the storage tool would read such an id as an option and fail, 1 format in 64 — as
    Kafka's own ``Uuid.randomUuid`` avoids)."""
    while True:
        cluster_id = base64.urlsafe_b64encode(draw()).rstrip(b"=").decode()
        if not cluster_id.startswith("-"):
            return cluster_id


class BrokerError(RuntimeError):
    """The broker could not be provisioned, started or stopped; the message says what to do."""


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    host: str
    port: int
    controller_port: int
    data_dir: Path
    cache_dir: Path
    heap_mb: int

    @classmethod
    def from_settings(cls, settings: Settings) -> BrokerConfig:
        return cls(
            host=settings.kafka_host,
            port=settings.kafka_port,
            controller_port=settings.kafka_controller_port,
            data_dir=settings.broker_data_dir,
            cache_dir=settings.cache_dir,
            heap_mb=settings.kafka_heap_mb,
        )

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class BrokerStatus:
    running: bool
    answering: bool
    pid: int | None
    bootstrap: str
    data_dir: str
    log_file: str

    def as_dict(self) -> dict[str, object]:
        return {
            "running": self.running,
            "answering": self.answering,
            "pid": self.pid,
            "bootstrap": self.bootstrap,
            "data_dir": self.data_dir,
            "log_file": self.log_file,
        }


def server_properties(cfg: BrokerConfig) -> str:
    """The broker's configuration: loopback listeners, one node, fast group joins."""
    listeners = f"PLAINTEXT://{cfg.host}:{cfg.port},CONTROLLER://{cfg.host}:{cfg.controller_port}"
    lines = [
        "process.roles=broker,controller",
        "node.id=1",
        f"controller.quorum.voters=1@{cfg.host}:{cfg.controller_port}",
        f"listeners={listeners}",
        f"advertised.listeners=PLAINTEXT://{cfg.host}:{cfg.port}",
        "controller.listener.names=CONTROLLER",
        "inter.broker.listener.name=PLAINTEXT",
        "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        f"log.dirs={cfg.data_dir / 'logs'}",
        "num.partitions=1",
        # One node: internal topics cannot have more than one replica.
        "offsets.topic.replication.factor=1",
        "offsets.topic.num.partitions=8",
        "transaction.state.log.replication.factor=1",
        "transaction.state.log.min.isr=1",
        "share.coordinator.state.topic.replication.factor=1",
        "share.coordinator.state.topic.min.isr=1",
        # The default 3 s delay makes every test's first consumer group join slow.
        "group.initial.rebalance.delay.ms=0",
        # Topics are created by their owners with the catalog's partition counts; an
        # auto-created topic would get 1 partition (one worker slot) by accident.
        "auto.create.topics.enable=false",
        "log.retention.hours=24",
        "log.segment.bytes=67108864",
        # The log cleaner (compacted topics) allocates its dedupe map at start-up: 128 MB
        # by default, half of a 256 MB heap, and the start sometimes failed with
        # OutOfMemoryError. 16 MB indexes ~700k keys per cleaning pass, ample here.
        "log.cleaner.dedupe.buffer.size=16777216",
    ]
    return "\n".join(lines) + "\n"


class KafkaBroker:
    """Manages one embedded broker; every method is idempotent."""

    def __init__(self, cfg: BrokerConfig) -> None:
        self.cfg = cfg
        self.pid_file = cfg.data_dir / "kafka.pid"
        self.log_file = cfg.data_dir / "kafka.log"
        self.props_file = cfg.data_dir / "server.properties"
        # The Popen of a broker this object started, kept so it is reaped on `down` (a
        # detached broker outlives the CLI; then only the pid file knows it).
        self._proc: subprocess.Popen[bytes] | None = None

    # -- provisioning -------------------------------------------------------------------
    def provision(self) -> Path:
        """Fetch the jars into the cache (once) and return the libs folder.

        The fetch runs in a process group of its own, stopped whole if this process is
        interrupted (SIGTERM, Ctrl-C): killing the script alone left its Maven running, and
        the next ``llmq up`` started a second fetch into the same folder."""
        script = INFRA_DIR / "fetch.sh"
        with process.stop_signals_raise():
            try:
                fetch = subprocess.Popen(
                    ["bash", str(script), str(self.cfg.cache_dir)], stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                    start_new_session=True,
                )
            except FileNotFoundError as exc:
                raise BrokerError(f"cannot run {script}: {exc}") from exc
            try:
                out, err = fetch.communicate()
            except BaseException:
                os.killpg(fetch.pid, signal.SIGKILL)
                fetch.wait()
                raise
        if fetch.returncode != 0:
            raise BrokerError(
                f"fetching Kafka from Maven Central failed (needs mvn and java 17+):\n"
                f"{err.strip()[-2000:]}"
            )
        return Path(out.strip().splitlines()[-1])

    def _java_cmd(self, libs: Path, main: str, *args: str) -> list[str]:
        return [
            "java",
            f"-Xmx{self.cfg.heap_mb}m",
            "-Xms128m",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={INFRA_DIR / 'log4j2.yaml'}",
            "-cp",
            f"{libs}/*",
            main,
            *args,
        ]

    def _format_once(self, libs: Path) -> None:
        if (self.cfg.data_dir / "logs" / "meta.properties").exists():
            return
        cluster_id = new_cluster_id()
        cmd = self._java_cmd(
            libs, "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(self.props_file)
        )
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            # The tool logs to stdout and says why it failed on stderr: show both.
            raise BrokerError(f"formatting broker storage failed (exit {done.returncode}):\n"
                              f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")

    # -- state --------------------------------------------------------------------------
    def _pid(self) -> int | None:
        """The PID of *our* broker if it is alive (a reused PID of another program is not)."""
        return process.own_pid(self.pid_file, ("kafka.Kafka", str(self.props_file)))

    def status(self) -> BrokerStatus:
        pid = self._pid()
        answering = pid is not None and asyncio.run(broker_answers(self.cfg.bootstrap, 3.0))
        return BrokerStatus(
            running=pid is not None,
            answering=answering,
            pid=pid,
            bootstrap=self.cfg.bootstrap,
            data_dir=str(self.cfg.data_dir),
            log_file=str(self.log_file),
        )

    # -- lifecycle ----------------------------------------------------------------------
    def up(self, timeout_s: float = 90.0) -> BrokerStatus:
        """Start the broker in the background unless it runs; wait until it answers."""
        proc = None if self._pid() is not None else self._start()
        try:
            with process.stopped_on_failure(proc, self.pid_file, 10.0):
                outcome = process.wait_ready(
                    proc, lambda: self._pid() is not None,
                    lambda: asyncio.run(broker_answers(self.cfg.bootstrap, 2.0)), timeout_s, 0.3)
                if outcome == "exited":
                    raise BrokerError(f"the broker exited during start; see {self.log_file}")
                if outcome == "timeout":
                    raise BrokerError(f"the broker did not answer within {timeout_s:.0f} s; "
                                      f"see {self.log_file}")
                # Freshly started: let it create __consumer_offsets, or say it did not.
                if proc is not None and not asyncio.run(
                        wait_for_group_coordinator(self.cfg.bootstrap, 60.0)):
                    raise BrokerError("the broker answers but coordinated no consumer group "
                                      f"within 60 s; see {self.log_file}")
        except BaseException:
            if proc is not None:
                self._proc = None  # stopped and reaped above
            raise
        return self.status()

    def _start(self) -> subprocess.Popen[bytes]:
        for port in (self.cfg.port, self.cfg.controller_port):
            if process.port_taken(self.cfg.host, port):
                raise BrokerError(
                    f"port {self.cfg.host}:{port} is taken by another program; stop it or set "
                    "LLMQ_KAFKA_PORT / LLMQ_KAFKA_CONTROLLER_PORT"
                )
        libs = self.provision()
        self.cfg.data_dir.mkdir(parents=True, exist_ok=True)
        self.props_file.write_text(server_properties(self.cfg))
        self._format_once(libs)
        cmd = self._java_cmd(libs, "kafka.Kafka", str(self.props_file))
        proc = process.start_detached(cmd, self.log_file, self.cfg.data_dir)
        self.pid_file.write_text(f"{proc.pid}\n")
        self._proc = proc
        return proc

    def down(self, timeout_s: float = 30.0) -> bool:
        """Stop our broker (SIGTERM, then SIGKILL after the timeout). False if none ran."""
        pid = self._pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        process.stop(pid, timeout_s, self._proc)
        self._proc = None
        self.pid_file.unlink(missing_ok=True)
        return True

