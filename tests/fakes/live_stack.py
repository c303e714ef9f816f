"""Test-only: wait until a live stack started with ``services.stack.Stack`` serves requests,
and reach or restart its processes by name.

Shared by the end-to-end, observability and ``llmq top`` stack tests. Fails fast with the
log tail of the first child that exited.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx

from services.stack import ServiceSpec, Stack, StackConfig, metrics_ports
from tests.fakes.ports import free_port_block


def loopback_config(**fields: object) -> StackConfig:
    """A :class:`StackConfig` whose HTTP, health and metrics ports are one free block."""
    cfg = StackConfig(**fields)  # type: ignore[arg-type]
    base = free_port_block(2 + len(metrics_ports(cfg)))
    return replace(cfg, http_port=base, health_port=base + 1, metrics_base_port=base + 2)


def wait_stack_ready(
    stack: Stack,
    base_url: str,
    log_dir: Path,
    timeout_s: float,
    *,
    api_key: str = "open-key",
    also: Callable[[float], bool] | None = None,
) -> None:
    """Poll /readyz and /v1/models (and ``also(deadline)``) until the stack is ready."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = stack.failed()
        if dead:
            name = dead[0][0]
            tail = (log_dir / f"{name}.log").read_text(errors="replace")[-3000:]
            raise AssertionError(f"stack process exited: {dead}; {name}'s log ends:\n{tail}")
        try:
            ready = httpx.get(f"{base_url}/readyz", timeout=2)
            models = httpx.get(f"{base_url}/v1/models", timeout=2,
                               headers={"Authorization": f"Bearer {api_key}"})
            if (ready.status_code == 200 and models.status_code == 200
                    and models.json().get("data") and (also is None or also(deadline))):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"stack not ready in {timeout_s} s; logs in {log_dir}")


def write_tenants_file(path: Path) -> Path:
    """Two tenants for a live stack: ``default`` (key ``open-key``, limits far above any
    test) and ``limited`` (key ``limited-key``, 1 request a minute)."""
    open_digest = hashlib.sha256(b"open-key").hexdigest()
    limited = hashlib.sha256(b"limited-key").hexdigest()
    path.write_text(
        "[tenants.default]\n"
        f'api_key_sha256 = ["{open_digest}"]\n'
        "rpm = 100000\ntpm = 100000000\nmax_concurrency = 10000\n\n"
        "[tenants.limited]\n"
        f'api_key_sha256 = ["{limited}"]\n'
        "rpm = 1\ntpm = 100000\nmax_concurrency = 100\n"
    )
    return path


class StackProcs:
    """The processes of a test stack by name, and restarting one (after a kill -9).

    Needs ``stack`` (its :class:`Stack`), ``specs``, ``env`` (the settings environment)
    and ``log_dir``."""

    stack: Stack
    specs: list[ServiceSpec]
    env: dict[str, str]
    log_dir: Path

    def proc(self, name: str) -> subprocess.Popen[bytes]:
        return next(p for s, p in self.stack.procs if s.name == name)

    def spec(self, name: str) -> ServiceSpec:
        return next(s for s in self.specs if s.name == name)

    def restart(self, name: str) -> None:
        """Start a fresh process for ``name`` (after it was killed)."""
        spec = self.spec(name)
        env = {**os.environ, **self.env, **dict(spec.env), "PYTHONUNBUFFERED": "1"}
        with (self.log_dir / f"{name}.restart.log").open("ab") as log:
            proc = subprocess.Popen(spec.argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.stack.procs = [(s, proc if s.name == name else p) for s, p in self.stack.procs]

