"""A local Jaeger (v2, ``cmd/jaeger`` v1.76.0): build once, start, wait, stop by PID.

``llmq dev jaeger up|down|status|build`` (the click group :data:`jaeger`, registered under
``llmq dev`` by ``services/cli.py``). The binary is built from ``infra/jaeger/go.mod`` (its
own module; ``go build`` resolves from the Go module cache, or through the module proxy)
into ``<home>/cache/jaeger/jaeger-v1.76.0`` the first time — that takes minutes, so it
says so and reports progress — and reused afterwards. It runs in the background with
``infra/jaeger/config.yaml``: in-memory storage, every listener on 127.0.0.1 (OTLP gRPC
4317, OTLP/HTTP 4318, query API and UI 16686, query gRPC 16685), nothing else opened.
Services export to :data:`OTLP_HTTP_TRACES` when ``LLMQ_OTLP_ENDPOINT`` says so.

Files under ``<home>/jaeger``: ``jaeger.pid``, ``jaeger.log``. Every method is idempotent.
A binary built without the UI assets (``go build`` from the module does not embed them)
serves the query API in full and a placeholder page at ``/``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import click

from services.common.settings import PROJECT_ROOT, Settings
from services.dev import process
from services.ops.params import seconds

VERSION: Final = "v1.76.0"
MODULE: Final = "github.com/jaegertracing/jaeger/cmd/jaeger"
INFRA_DIR: Final = PROJECT_ROOT / "infra" / "jaeger"
CONFIG_FILE: Final = INFRA_DIR / "config.yaml"
HOST: Final = "127.0.0.1"
#: Listeners of config.yaml (kept in step with it; a unit test checks).
PORTS: Final = {"otlp_grpc": 4317, "otlp_http": 4318, "query_http": 16686, "query_grpc": 16685}
QUERY_URL: Final = f"http://{HOST}:{PORTS['query_http']}"
#: What ``LLMQ_OTLP_ENDPOINT`` is set to for services exporting to this Jaeger.
OTLP_HTTP_TRACES: Final = f"http://{HOST}:{PORTS['otlp_http']}/v1/traces"

Echo = Callable[[str], object]

#: Jaegers this process started, kept (not reaped) while they run: a ``Popen`` dropped while
#: its child lives warns (ResourceWarning) — in a CLI process that exits right away harmless,
#: in a long-lived one (tests) noise. ``down`` reaps and forgets them.
_STARTED: dict[int, subprocess.Popen[bytes]] = {}


class JaegerError(RuntimeError):
    """Jaeger could not be built, started or stopped; the message says what to do."""


@dataclass(frozen=True, slots=True)
class JaegerStatus:
    running: bool
    answering: bool
    pid: int | None
    built: bool
    binary: str
    log_file: str

    def as_dict(self) -> dict[str, object]:
        return {
            "running": self.running, "answering": self.answering, "pid": self.pid,
            "built": self.built, "binary": self.binary, "log_file": self.log_file,
            "ui": QUERY_URL, "query_api": f"{QUERY_URL}/api",
            "otlp_http_traces": OTLP_HTTP_TRACES,
            "otlp_grpc": f"{HOST}:{PORTS['otlp_grpc']}",
        }


def query_answers(timeout_s: float = 2.0) -> bool:
    """True when a Jaeger query API answers on :data:`QUERY_URL`."""
    try:
        with urllib.request.urlopen(f"{QUERY_URL}/api/services", timeout=timeout_s) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class Jaeger:
    """Manages one local Jaeger (module docstring)."""

    def __init__(self, home: Path, cache_dir: Path) -> None:
        self.binary = cache_dir / "jaeger" / f"jaeger-{VERSION}"
        self.data_dir = home / "jaeger"
        self.pid_file = self.data_dir / "jaeger.pid"
        self.log_file = self.data_dir / "jaeger.log"

    @classmethod
    def from_settings(cls, settings: Settings) -> Jaeger:
        return cls(settings.home, settings.cache_dir)

    # -- building ----------------------------------------------------------------------
    def build(self, echo: Echo = print, timeout_s: float = 1800.0) -> Path:
        """Build the binary once (``go build`` in infra/jaeger); reuse it afterwards."""
        if self.binary.is_file():
            return self.binary
        go = shutil.which("go")
        if go is None:
            raise JaegerError("building Jaeger needs Go (`go` on PATH); see infra/jaeger/go.mod")
        self.binary.parent.mkdir(parents=True, exist_ok=True)
        partial = self.binary.with_name(self.binary.name + ".partial")
        echo(f"building Jaeger {VERSION} into {self.binary} (go build; the first build "
             "takes several minutes)…")
        started = time.monotonic()
        next_note = started + 30.0
        with (self.binary.parent / "build.log").open("wb") as log, \
                process.stop_signals_raise():
            proc = subprocess.Popen(
                [go, "build", "-o", str(partial), MODULE], cwd=INFRA_DIR, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
            try:
                while proc.poll() is None:
                    if time.monotonic() - started > timeout_s:
                        raise JaegerError(f"go build did not finish within {timeout_s:.0f} s")
                    time.sleep(0.5)
                    if time.monotonic() >= next_note:
                        next_note += 30.0
                        echo(f"  still building Jaeger ({time.monotonic() - started:.0f} s)…")
            except BaseException:
                # Timed out, or this process was told to stop (SIGTERM is SystemExit here):
                # a build left running would race the next `llmq up`'s over .partial.
                os.killpg(proc.pid, signal.SIGKILL)  # go and the compilers it runs
                proc.wait()
                partial.unlink(missing_ok=True)
                raise
        if proc.returncode != 0:
            tail = (self.binary.parent / "build.log").read_text(errors="replace")[-2000:]
            partial.unlink(missing_ok=True)
            raise JaegerError(f"go build of {MODULE} failed:\n{tail}")
        partial.replace(self.binary)  # atomic: a half-written binary is never reused
        echo(f"built Jaeger in {time.monotonic() - started:.0f} s")
        return self.binary

    # -- state -------------------------------------------------------------------------
    def _pid(self) -> int | None:
        """The PID of *our* Jaeger if it is alive (a reused PID of another program is not)."""
        return process.own_pid(self.pid_file, (str(self.binary), str(CONFIG_FILE)))

    def status(self) -> JaegerStatus:
        pid = self._pid()
        return JaegerStatus(
            running=pid is not None, answering=pid is not None and query_answers(),
            pid=pid, built=self.binary.is_file(), binary=str(self.binary),
            log_file=str(self.log_file),
        )

    # -- lifecycle ---------------------------------------------------------------------
    def up(self, timeout_s: float = 60.0, echo: Echo = print) -> JaegerStatus:
        """Build if needed, start in the background unless it runs, wait for the API."""
        proc = None if self._pid() is not None else self._start(echo)
        try:
            with process.stopped_on_failure(proc, self.pid_file, 5.0):
                outcome = process.wait_ready(proc, lambda: self._pid() is not None,
                                             lambda: query_answers(1.0), timeout_s, 0.2)
                if outcome == "exited":
                    raise JaegerError(f"Jaeger exited during start; see {self.log_file}")
                if outcome == "timeout":
                    raise JaegerError(f"Jaeger's query API did not answer within "
                                      f"{timeout_s:.0f} s; see {self.log_file}")
        except BaseException:
            if proc is not None:
                _STARTED.pop(proc.pid, None)  # stopped and reaped above
            raise
        return self.status()

    def _start(self, echo: Echo) -> subprocess.Popen[bytes]:
        binary = self.build(echo)
        taken = [f"{HOST}:{port}" for port in PORTS.values() if process.port_taken(HOST, port)]
        if taken:
            raise JaegerError(f"{', '.join(taken)} taken by another program (another Jaeger "
                              "or collector?); stop it first")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        proc = process.start_detached(
            [str(binary), "--config", str(CONFIG_FILE)], self.log_file, self.data_dir
        )
        self.pid_file.write_text(f"{proc.pid}\n")
        _STARTED[proc.pid] = proc
        return proc

    def down(self, timeout_s: float = 15.0) -> bool:
        """Stop our Jaeger (SIGTERM, then SIGKILL after the timeout). False if none ran."""
        pid = self._pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        process.stop(pid, timeout_s, _STARTED.pop(pid, None))
        self.pid_file.unlink(missing_ok=True)
        return True


# -- the command line ---------------------------------------------------------------------
def _jaeger(obj: Any) -> Jaeger:
    settings = obj if isinstance(obj, Settings) else Settings()
    return Jaeger.from_settings(settings)


def _emit(data: dict[str, object], as_json: bool, text: str) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True) if as_json else text)


@click.group()
def jaeger() -> None:
    """Jaeger (traces) on 127.0.0.1: built once from infra/jaeger, memory storage."""


@jaeger.command("up")
@click.option("--timeout", default=60.0, show_default=True, type=seconds(3600),
              help="Seconds to wait for the query API (the build is not counted).")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.pass_obj
def jaeger_up(obj: Any, timeout: float, as_json: bool) -> None:
    """Build (once) and start Jaeger in the background; idempotent."""
    # Progress goes to stderr so that --json output stays parseable.
    try:
        status = _jaeger(obj).up(timeout, echo=lambda line: click.echo(line, err=True))
    except JaegerError as exc:
        raise click.ClickException(str(exc)) from exc
    _emit(status.as_dict(), as_json,
          f"jaeger is up (pid {status.pid}): UI and API {QUERY_URL}, OTLP/HTTP "
          f"{OTLP_HTTP_TRACES} (export with LLMQ_OTLP_ENDPOINT={OTLP_HTTP_TRACES}); "
          f"log {status.log_file}")


@jaeger.command("build")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_obj
def jaeger_build(obj: Any, as_json: bool) -> None:
    """Build the binary once (for `make test`); a no-op when it is cached."""
    try:
        binary = _jaeger(obj).build(echo=lambda line: click.echo(line, err=True))
    except JaegerError as exc:
        raise click.ClickException(str(exc)) from exc
    _emit({"binary": str(binary)}, as_json, f"jaeger binary: {binary}")


@jaeger.command("down")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_obj
def jaeger_down(obj: Any, as_json: bool) -> None:
    """Stop the Jaeger started by `up` (by its PID); harmless when none runs."""
    stopped = _jaeger(obj).down()
    _emit({"stopped": stopped}, as_json,
          "jaeger stopped" if stopped else "jaeger was not running")


@jaeger.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.pass_obj
def jaeger_status(obj: Any, as_json: bool) -> None:
    """Is Jaeger running and answering? Exit status 0 when it answers."""
    status = _jaeger(obj).status()
    state = "up" if status.answering else ("starting" if status.running else "down")
    _emit(status.as_dict(), as_json, f"jaeger is {state} ({QUERY_URL})"
          + ("" if status.built else "; not built yet (`llmq dev jaeger up` builds it)"))
    sys.exit(0 if status.answering else 1)
