"""The local stack: every llmq service as a child process, one log stream, clean stop.

``llmq up`` calls :func:`run_foreground`: it starts Kafka (embedded, in the background),
creates the topics, then starts ingest, scheduler, health and the workers as child
processes whose output is merged into this terminal with a coloured ``name |`` prefix.
Ctrl-C (or SIGTERM) stops the children in reverse order — SIGTERM first, so workers drain,
then SIGKILL after a grace period — and leaves no process behind. ``--detach`` writes a
pid file per child under ``<home>/stack/`` instead, and ``llmq down`` stops them by pid.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Final

from services.common.settings import Settings
from services.dev import process

_COLOURS = ("36", "35", "33", "32", "34", "31", "96", "95")


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """One child process of the stack."""

    name: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    #: Seconds to wait after starting it before the next one (ordering, not correctness).
    settle_s: float = 0.0


@dataclass(frozen=True, slots=True)
class StackConfig:
    short_workers: int = 2
    long_workers: int = 1
    any_workers: int = 0
    #: Workers of a prefill/decode split (pool ``any``, roles ``prefill`` and ``decode``).
    prefill_workers: int = 0
    decode_workers: int = 0
    #: Scheduler replicas: one consumer group, placing in turns (docs/live-system.md).
    schedulers: int = 1
    http_port: int = 8080
    health_port: int = 8081
    metrics_base_port: int = 9400
    #: Sim engine speed: 1.0 is real time; tests use e.g. 0.05 (20× faster).
    time_scale: float = 1.0
    profile: str = "llama3-8b-h100"
    model: str = "llama-3.1-8b"
    extra_env: tuple[tuple[str, str], ...] = field(default=())


#: Services of the stack besides the workers: scheduler, ingest, health (and the other
#: scheduler replicas, whose ports come after the workers').
_SERVICES_BESIDE_WORKERS = 3
_MAX_PORT = 65_535


def worker_count(cfg: StackConfig) -> int:
    return (cfg.short_workers + cfg.long_workers + cfg.any_workers + cfg.prefill_workers
            + cfg.decode_workers)


def metrics_ports(cfg: StackConfig) -> range:
    """The services' Prometheus ports: one each, upwards from ``metrics_base_port``: the
    scheduler, ingest, health, the workers, then the other scheduler replicas (so the
    default stack's ports do not move with ``schedulers``)."""
    count = _SERVICES_BESIDE_WORKERS + worker_count(cfg) + cfg.schedulers - 1
    return range(cfg.metrics_base_port, cfg.metrics_base_port + count)


def config_problem(cfg: StackConfig, slots: int,
                   taken: Mapping[int, str] | None = None) -> tuple[str, str] | None:
    """``(option, what is wrong)`` when the stack cannot run as configured, else None: found
    before anything starts, not in a child after Kafka did. ``slots``: partitions of the
    assignments topic (LLMQ_ASSIGNMENT_PARTITIONS), one per worker. ``taken``: ports the
    same command starts something else on (the embedded broker, Jaeger), by port: whose."""
    workers = worker_count(cfg)
    if workers > slots:
        return ("--short-workers/--long-workers/--any-workers/--prefill-workers/"
                "--decode-workers",
                f"{workers} workers need {workers} slots but LLMQ_ASSIGNMENT_PARTITIONS is "
                f"{slots}: run fewer workers or raise it")
    ports = metrics_ports(cfg)
    if ports[-1] > _MAX_PORT:
        return ("--metrics-base-port",
                f"the {len(ports)} services take one port each from {ports[0]} up, past "
                f"{_MAX_PORT}: give at most {_MAX_PORT - len(ports) + 1}")
    if cfg.health_port == cfg.http_port:
        return "--health-port", f"{cfg.health_port} is --http-port too: give another port"
    for option, port in (("--http-port", cfg.http_port), ("--health-port", cfg.health_port)):
        if port in ports:
            return (option, f"{port} is one of the metrics ports {ports[0]}-{ports[-1]} "
                            "(--metrics-base-port and up): give another port")
    for port, whose in sorted((taken or {}).items()):
        for option, mine in (("--http-port", (cfg.http_port,)),
                             ("--health-port", (cfg.health_port,)),
                             ("--metrics-base-port", ports)):
            if port in mine:
                return option, f"{port} is {whose}: give another port"
    return None


def stack_services(cfg: StackConfig) -> list[ServiceSpec]:
    """The processes of the local stack, in start order."""
    py = sys.executable
    port = iter(metrics_ports(cfg))
    ports = list(metrics_ports(cfg))
    extra_ports = iter(ports[len(ports) - (cfg.schedulers - 1):])
    # Replicas need an id each (the default is one per host): scheduler-1, scheduler-2, ...
    ids = [(("LLMQ_SCHEDULER_SCHEDULER_ID", f"scheduler-{i}"),) if cfg.schedulers > 1 else ()
           for i in range(1, cfg.schedulers + 1)]
    specs = [
        ServiceSpec(
            "scheduler",
            (py, "-m", "services.scheduler"),
            (("LLMQ_METRICS_PORT", str(next(port))), *ids[0]),
        ),
        *(ServiceSpec(f"scheduler-{i}", (py, "-m", "services.scheduler"),
                      (("LLMQ_METRICS_PORT", str(next(extra_ports))), *ids[i - 1]))
          for i in range(2, cfg.schedulers + 1)),
        ServiceSpec(
            "ingest",
            (py, "-m", "services.ingest"),
            # Both names: ingest reads LLMQ_INGEST_HTTP_PORT first, and one inherited from
            # the caller's environment would otherwise win over --http-port.
            (("LLMQ_INGEST_HTTP_PORT", str(cfg.http_port)), ("LLMQ_HTTP_PORT", str(cfg.http_port)),
             ("LLMQ_METRICS_PORT", str(next(port)))),
        ),
        ServiceSpec(
            "health",
            (py, "-m", "services.health"),
            (("LLMQ_HEALTH_PORT", str(cfg.health_port)), ("LLMQ_METRICS_PORT", str(next(port)))),
        ),
    ]
    slot = 0
    for pool, role, count in (("short", "mixed", cfg.short_workers),
                              ("long", "mixed", cfg.long_workers),
                              ("any", "mixed", cfg.any_workers),
                              ("any", "prefill", cfg.prefill_workers),
                              ("any", "decode", cfg.decode_workers)):
        for _ in range(count):
            specs.append(
                ServiceSpec(
                    f"worker-{slot}",
                    (py, "-m", "services.worker", "--slot", str(slot), "--pool", pool,
                     "--role", role,  # said even for mixed: LLMQ_WORKER_ROLE may be set
                     "--engine", "sim", "--profile", cfg.profile, "--model", cfg.model,
                     "--time-scale", str(cfg.time_scale)),
                    (("LLMQ_METRICS_PORT", str(next(port))),),
                )
            )
            slot += 1
    return specs


#: Settings the stack gives each child itself, not inherited from the caller's environment:
#: one worker id for every worker (LLMQ_WORKER_WORKER_ID) would make them one worker, and a
#: fixed count of scheduler replicas and index would give every replica one turn (the
#: stack's replicas take theirs from the consumer group).
_NAMED_BY_THE_STACK: Final = frozenset({
    "LLMQ_WORKER_WORKER_ID", "LLMQ_SCHEDULER_REPLICAS", "LLMQ_SCHEDULER_REPLICA_INDEX"})


def _pump(name: str, colour: str, stream: IO[bytes], out: IO[str], tty: bool) -> None:
    """Copy a child's output to ``out``, each line prefixed with the child's name. If ``out``
    goes away (``llmq up | head``, a pager quit) the child's output is still read, and
    dropped: a child whose pipe nobody reads blocks in its next write once the pipe's
    buffer is full, alive, so the stack never noticed it had stopped working."""
    prefix = f"\x1b[{colour}m{name:>10} |\x1b[0m " if tty else f"{name:>10} | "
    sink: IO[str] | None = out
    for raw in iter(stream.readline, b""):
        if sink is None:
            continue
        try:
            sink.write(prefix + raw.decode(errors="replace"))
            sink.flush()
        except (OSError, ValueError):  # a closed pipe; ValueError: a closed file object
            sink = None


class Stack:
    """Owns the child processes; ``stop()`` is idempotent."""

    def __init__(self, specs: Sequence[ServiceSpec], settings_env: dict[str, str]) -> None:
        self.specs = list(specs)
        self.env = settings_env
        self.procs: list[tuple[ServiceSpec, subprocess.Popen[bytes]]] = []
        self._threads: list[threading.Thread] = []

    def start(self, log_dir: Path | None = None) -> None:
        """Start every child; with ``log_dir`` they are detached and log to files there.
        If starting one fails (or Ctrl-C lands meanwhile), those already started are
        stopped before the error goes on: nothing is left running that nobody knows of."""
        try:
            self._start(log_dir)
        except BaseException:
            self.stop(grace_s=5.0)
            raise

    def _start(self, log_dir: Path | None) -> None:
        tty = sys.stdout.isatty()
        inherited = {k: v for k, v in os.environ.items() if k not in _NAMED_BY_THE_STACK}
        for i, spec in enumerate(self.specs):
            env = {**inherited, **self.env, **dict(spec.env), "PYTHONUNBUFFERED": "1"}
            if log_dir is not None:
                log_dir.mkdir(parents=True, exist_ok=True)
                with (log_dir / f"{spec.name}.log").open("ab") as log:
                    proc = subprocess.Popen(
                        spec.argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL, start_new_session=True,
                    )
                    self.procs.append((spec, proc))  # known at once: stop() reaches it
                continue
            # Own session: Ctrl-C reaches only this supervisor, which then sends each child
            # one SIGTERM (workers drain) instead of the terminal signalling them all twice.
            proc = subprocess.Popen(
                spec.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
            # Known before anything else can fail (the log thread's start, a Ctrl-C): in
            # its own session, a child stop() does not know of would outlive the stack.
            self.procs.append((spec, proc))
            assert proc.stdout is not None
            thread = threading.Thread(
                target=_pump,
                args=(spec.name, _COLOURS[i % len(_COLOURS)], proc.stdout, sys.stdout, tty),
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
            if spec.settle_s:
                time.sleep(spec.settle_s)

    def failed(self) -> list[tuple[str, int]]:
        """Children that exited, with their exit codes."""
        return [(s.name, p.returncode) for s, p in self.procs if p.poll() is not None]

    def stop(self, grace_s: float = 20.0) -> None:
        """The workers first (SIGTERM: they drain, and ingest is still there to stream what
        they finish; prefill workers before the rest, :func:`stop_stages`), then the other
        services; each stage SIGKILLed after ``grace_s``.
        A second Ctrl-C meanwhile does not cut this short (the grace bounds it)."""
        interrupt = signal.getsignal(signal.SIGINT)
        in_main = threading.current_thread() is threading.main_thread()
        if in_main:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            procs = dict((s.name, p) for s, p in self.procs)
            for stage in stop_stages([(s.name, s.argv) for s, _ in self.procs]):
                _terminate([procs[name] for name in stage], grace_s)
        finally:
            if in_main:
                signal.signal(signal.SIGINT, interrupt)
        for thread in self._threads:
            thread.join(timeout=2.0)
        for _, proc in self.procs:
            if proc.stdout is not None:
                proc.stdout.close()


def stop_stages(services: Sequence[tuple[str, Sequence[str]]]) -> list[list[str]]:
    """The order a stack stops in, by service name (given in start order, with argv):
    prefill workers first (a draining one waits until the decode workers took its
    hand-offs' KV, so those must still run), then the other workers (they drain while
    ingest still streams their answers), then the other services, last started first."""
    def prefill(argv: Sequence[str]) -> bool:
        return any(pair == ("--role", "prefill") for pair in itertools.pairwise(argv))

    workers = [(n, argv) for n, argv in services if n.startswith("worker-")]
    stages = [[n for n, argv in workers if prefill(argv)],
              [n for n, argv in workers if not prefill(argv)],
              [n for n, _ in reversed(services) if not n.startswith("worker-")]]
    return [stage for stage in stages if stage]


def _terminate(procs: Sequence[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM each, wait until ``grace_s`` is up, then SIGKILL what is left."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def settings_env(settings: Settings) -> dict[str, str]:
    """The settings the children must share, as LLMQ_* variables."""
    env = {
        "LLMQ_HOME": str(settings.home),
        "LLMQ_TOPIC_PREFIX": settings.topic_prefix,
        "LLMQ_ASSIGNMENT_PARTITIONS": str(settings.assignment_partitions),
        "LLMQ_KAFKA_PORT": str(settings.kafka_port),
        "LLMQ_KAFKA_HOST": settings.kafka_host,
    }
    if settings.kafka_bootstrap:
        env["LLMQ_KAFKA_BOOTSTRAP"] = settings.kafka_bootstrap
    return env


def run_foreground(stack: Stack, on_started: Callable[[], object] | None = None) -> int:
    """Run until Ctrl-C / SIGTERM or until a child dies; returns the exit status. A worker
    that exits 0 was drained (``llmq drain``: it finished its work and left the fleet on
    purpose); the rest of the stack runs on without it."""
    # A plain flag, not a threading.Event: the handler runs in the main thread between two
    # bytecodes, possibly while that thread holds the Event's lock inside Event.wait(), and
    # Event.set() would then wait on it forever (seen: `timeout … make up` hung, its
    # children zombies; the same bug as CPython's multiprocessing.Event, gh-126434).
    stopping: list[int] = []

    def _on_signal(signum: int, _frame: object) -> None:
        stopping.append(signum)

    # SIGHUP (the terminal closed, ssh dropped) and SIGQUIT stop the stack like SIGTERM:
    # the children run in their own sessions, so nothing else would ever stop them.
    handled = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    previous = {sig: signal.signal(sig, _on_signal) for sig in handled}
    previous[signal.SIGINT] = signal.getsignal(signal.SIGINT)  # ignored while stopping
    status = 0
    try:
        stack.start()
        if on_started is not None:
            on_started()
        drained: set[str] = set()
        while not stopping:
            dead = [(name, code) for name, code in stack.failed() if name not in drained]
            for name, code in dead:
                if name.startswith("worker-") and code == 0:
                    print(f"llmq up: {name} drained and left; the rest runs on",
                          file=sys.stderr)
                    drained.add(name)
            dead = [(name, code) for name, code in dead if name not in drained]
            if dead:
                name, code = dead[0]
                print(f"llmq up: {name} exited with status {code}; stopping the stack",
                      file=sys.stderr)
                status = 1
                break
            time.sleep(0.5)  # a signal cuts it short (PEP 475: the handler runs, then it
            # sleeps on; at most half a second more)
    except KeyboardInterrupt:
        pass
    finally:
        # A second Ctrl-C from here on must not cut the stop short (stop() ignores SIGINT
        # too, but only once it runs).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("llmq up: stopping…", file=sys.stderr)
        stack.stop()
        for sig, handler in previous.items():
            if handler is not None:  # None: not set from Python (it cannot be put back)
                signal.signal(sig, handler)
    return status


def stack_dir(settings: Settings) -> Path:
    """``<home>/stack``: services.json and, when detached, one log file per service."""
    return settings.home / "stack"


class StackBusy(Exception):
    """Another ``llmq up`` holds this home's start lock."""


@contextlib.contextmanager
def start_lock(settings: Settings) -> Iterator[None]:
    """Hold ``<home>/stack/up.lock`` (an exclusive ``flock``) for as long as an ``llmq up``
    runs: services.json, which tells a second ``llmq up`` that a stack runs, is written only
    once the broker, Jaeger and the services are up, minutes after the start; a second one
    started meanwhile overwrote it and, failing on the ports, deleted it, and the first
    stack ran on unrecorded (``llmq down`` stopped nothing). The kernel drops the lock when
    its holder exits, however it exits; the children started do not inherit it."""
    path = stack_dir(settings) / "up.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StackBusy(f"another `llmq up` is starting or running with this LLMQ_HOME "
                            f"({path} is locked); wait for it, or stop it first") from None
        yield


def metrics_url(spec: ServiceSpec) -> str | None:
    port = dict(spec.env).get("LLMQ_METRICS_PORT")
    return f"http://127.0.0.1:{port}/metrics" if port else None


def write_services_file(settings: Settings, stack: Stack) -> Path:
    """Record every child's pid and metrics URL in ``<home>/stack/services.json``.

    ``llmq status`` reads ``metrics_urls`` from it and ``llmq down`` the pids.
    """
    path = stack_dir(settings) / "services.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        spec.name: {"pid": proc.pid, "metrics_url": metrics_url(spec), "argv": list(spec.argv),
                    "started": process_started(proc.pid)}
        for spec, proc in stack.procs
    }
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


class ServicesFileError(ValueError):
    """services.json is not what ``llmq up`` writes; the message names it and what to do."""


@dataclass(frozen=True, slots=True)
class RecordedService:
    """A child of a stack as services.json records it."""

    name: str
    pid: int
    argv: tuple[str, ...]
    #: When the process started (:func:`process_started`); None in a file written before
    #: it was recorded.
    started: int | None = None


def _warn(message: str) -> None:
    print(f"llmq: warning: {message}", file=sys.stderr, flush=True)


def read_services_file(path: Path) -> list[RecordedService]:
    """The services recorded in ``path`` (:func:`write_services_file`); [] when it does
    not exist. An entry without a pid (an integer ≥ 1) and an argv (a list of strings) is
    skipped with a one-line warning naming the file and the entry: one bad entry must not
    keep the others running. Raises :class:`ServicesFileError` when the file cannot be read
    or is not a JSON object."""
    todo = (f"stop the services it lists by hand (their logs are in {path.parent}), then "
            "delete it")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ServicesFileError(f"cannot read {path} ({exc.strerror}): {todo}") from exc
    except ValueError as exc:  # UnicodeDecodeError is a ValueError too
        raise ServicesFileError(f"{path} is not JSON ({exc}): {todo}") from exc
    if not isinstance(data, dict):
        raise ServicesFileError(f"{path} is not a JSON object of services: {todo}")
    found = []
    for name, entry in data.items():
        why = _bad_entry(entry)
        if why is not None:
            _warn(f"ignoring entry {name!r} of {path}: {why} (stop it by hand if it runs)")
            continue
        started = entry.get("started")
        found.append(RecordedService(name, entry["pid"], tuple(entry["argv"]),
                                     started if type(started) is int else None))
    return found


def _bad_entry(entry: object) -> str | None:
    """What is wrong with one entry of services.json, or None."""
    if not isinstance(entry, dict):
        return f"{entry!r} is not an object with a pid and an argv"
    pid, argv = entry.get("pid"), entry.get("argv")
    if type(pid) is not int or pid < 1:  # a bool is not a pid either
        return f"its pid is {pid!r}, not an integer ≥ 1"
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        return f"its argv is {argv!r}, not a list of strings"
    return None


def stop_detached(settings: Settings, grace_s: float = 20.0) -> list[str]:
    """Stop the services a detached ``llmq up`` started (by the pids in services.json).

    Raises :class:`ServicesFileError` (and stops nothing) when services.json is not a JSON
    object; bad entries are skipped (:func:`read_services_file`).
    """
    path = stack_dir(settings) / "services.json"
    alive = {s.name: s for s in read_services_file(path) if _is_ours(s)}
    # As Stack.stop: the workers drain first, then the services that stream their answers.
    for names in stop_stages([(s.name, s.argv) for s in alive.values()]):
        stage = [alive[n] for n in names]
        for service in stage:
            process.send(service.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(process.alive(s.pid) for s in stage) and time.monotonic() < deadline:
            time.sleep(0.1)
        for service in stage:
            if process.alive(service.pid) and _is_ours(service):  # not a pid reused since
                process.send(service.pid, signal.SIGKILL)
    path.unlink(missing_ok=True)
    return list(alive)


def running_services(settings: Settings) -> list[str]:
    """Services of a stack recorded in services.json that still run (by pid and command).

    Raises :class:`ServicesFileError` when services.json is not a JSON object: what runs
    is unknown then.
    """
    path = stack_dir(settings) / "services.json"
    return [s.name for s in read_services_file(path) if _is_ours(s)]


def _is_ours(service: RecordedService) -> bool:
    """The pid still runs the process we started: the same command and, when recorded, the
    same start time (the same argv alone is every stack's, whatever its LLMQ_HOME: a pid
    reused by another stack's service would be stopped)."""
    try:
        cmdline = Path(f"/proc/{service.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if [c.decode(errors="replace") for c in cmdline if c] != list(service.argv):
        return False
    return service.started is None or process_started(service.pid) == service.started


def process_started(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``, field 22):
    with the pid, one process's identity. None when it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None
