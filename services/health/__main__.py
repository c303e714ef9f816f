"""``python -m services.health``: the health service.

Settings are read here, once: ``LLMQ_*`` (shared) and ``LLMQ_HEALTH_*`` / ``LLMQ_CONSUL_ADDR``
/ ``LLMQ_METRICS_PORT`` (see :mod:`services.health.settings`); flags override them. Then it
binds ``127.0.0.1:<port>`` for /healthz, /readyz and /status, starts the metrics server if
a port is set, and runs :class:`~services.health.service.HealthService` until SIGINT or
SIGTERM (exit 0). Without ``LLMQ_CONSUL_ADDR`` there is no Consul mirror; everything else
runs the same. Exit status 2: bad configuration (one line naming the flag or variable) or
the port cannot be bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Generator, Mapping, Sequence
from typing import Any, NoReturn

import uvicorn
from pydantic import ValidationError

from services.common import tracing
from services.common.settings import Settings, describe_invalid, warn_unknown_env
from services.health.consul_registry import ConsulRegistry
from services.health.http import create_app
from services.health.metrics import HealthMetrics
from services.health.registry import Registry
from services.health.service import HealthService
from services.health.settings import BIND_HOST, HealthSettings

_log = logging.getLogger("services.health")


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: this process owns SIGINT/SIGTERM (and uvicorn
    would re-raise the signal after shutdown, turning a clean stop into a kill)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class _Parser(argparse.ArgumentParser):
    """A usage error is one line (not usage and error), exit 2 as argparse does."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"health: invalid configuration: {message} (see --help)\n")


#: The flag of each setting the command line can set (the error names what was given).
_FLAGS = {"port": "--port", "consul_addr": "--consul-addr", "metrics_port": "--metrics-port",
          "log_level": "--loglevel"}


def _describe_invalid(exc: ValidationError, flags: Mapping[str, Any]) -> str:
    """One line naming each bad setting as the operator gave it: a flag of ``flags``, else
    the variable. :func:`describe_invalid` names variables by prefix and field, but a
    field with an alias (``LLMQ_CONSUL_ADDR``) is reported under the alias, already a
    whole variable name, and a flag is not a variable at all."""
    lines = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else ""
        if field in flags:
            name = _FLAGS.get(field, field)
        elif field.startswith("LLMQ_"):
            name = field
        else:
            name = "LLMQ_HEALTH_" + field.upper()
        lines.append(f"{name}={error.get('input')!r}: {error['msg']}")
    return "; ".join(lines)


def _parse(argv: Sequence[str] | None) -> dict[str, Any]:
    parser = _Parser(
        prog="python -m services.health",
        description="llmq health: heartbeats → Consul (optional), /healthz /readyz /status.",
        epilog="Other settings: LLMQ_HEALTH_* (services/health/settings.py). Exit status 0 "
               "when stopped by SIGINT or SIGTERM, 2 on bad configuration or a port that "
               "cannot be bound.",
    )
    parser.add_argument("--port", type=int, help="HTTP port on 127.0.0.1, 1-65535 "
                        "(LLMQ_HEALTH_PORT; default 8081)")
    parser.add_argument("--consul-addr", dest="consul_addr",
                        help="Consul agent host:port (LLMQ_CONSUL_ADDR)")
    parser.add_argument("--metrics-port", dest="metrics_port", type=int,
                        help="Prometheus port on 127.0.0.1, 1-65535 "
                        "(LLMQ_METRICS_PORT; default: none)")
    parser.add_argument("--loglevel", dest="log_level",
                        choices=("debug", "info", "warning", "error"),
                        help="log level (LLMQ_HEALTH_LOG_LEVEL; default info)")
    args = vars(parser.parse_args(argv))
    return {name: value for name, value in args.items() if value is not None}


def _bind(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((BIND_HOST, port))
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def serve(
    settings: Settings, hs: HealthSettings, sock: socket.socket, metrics: HealthMetrics
) -> None:
    registry: Registry | None = None
    consul = hs.consul()
    if consul is not None:
        registry = ConsulRegistry(consul, hs.consul_token)
    service = HealthService(settings, hs, registry=registry, metrics=metrics)
    server = _Server(uvicorn.Config(create_app(service), log_config=None, access_log=False,
                                    lifespan="off"))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    http = asyncio.create_task(server.serve(sockets=[sock]), name="health-http")
    print(
        f"health: http://{BIND_HOST}:{hs.port}/{{healthz,readyz,status}}, broker "
        f"{settings.bootstrap}, prefix {settings.topic_prefix}, consul "
        f"{hs.consul_addr or 'off'}, metrics "
        f"{f'http://{BIND_HOST}:{hs.metrics_port}/metrics' if hs.metrics_port else 'off'}",
        file=sys.stderr, flush=True,
    )
    try:
        await service.run(stop)
    finally:
        server.should_exit = True
        await http


def main(argv: Sequence[str] | None = None) -> int:
    overrides = _parse(argv)
    warn_unknown_env("health", HealthSettings, os.environ)
    try:
        settings = Settings()
    except ValidationError as exc:
        print(f"health: invalid configuration: {describe_invalid(exc)}", file=sys.stderr)
        return 2
    try:
        hs = HealthSettings(**overrides)
    except ValidationError as exc:
        print(f"health: invalid configuration: {_describe_invalid(exc, overrides)}",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=hs.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sock = _bind(hs.port)
    except OSError as exc:
        print(f"health: cannot listen on {BIND_HOST}:{hs.port}: {exc}", file=sys.stderr)
        return 2
    metrics = HealthMetrics()
    tracing.setup("llmq-health", settings.otlp_endpoint, settings.trace_sample_ratio)
    if hs.metrics_port is not None:
        try:
            metrics.serve(hs.metrics_port)
        except OSError as exc:
            sock.close()
            print(f"health: cannot serve metrics on {BIND_HOST}:{hs.metrics_port}: {exc}",
                  file=sys.stderr)
            return 2
    asyncio.run(serve(settings, hs, sock, metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
