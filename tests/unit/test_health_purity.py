"""The health core and the drain progress rules import no infrastructure (DESIGN.md, "The
pure core"). Each module is imported in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

FORBIDDEN = ("faust", "aiokafka", "consul", "vllm", "pynvml", "fastapi", "prometheus_client")


@pytest.mark.parametrize("module", ["services.health.core", "services.ops.drain_progress"])
def test_imports_no_infrastructure(module: str) -> None:
    code = f"import {module}, sys; print([m for m in {FORBIDDEN!r} if m in sys.modules])"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"{module} imports {done.stdout.strip()}"
