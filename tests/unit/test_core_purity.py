"""The pure cores import no infrastructure (DESIGN.md, "The pure core").

Each module is imported in a fresh interpreter, so what other tests imported does not
mask a stray import.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

FORBIDDEN = ("faust", "aiokafka", "consul", "vllm", "pynvml")


@pytest.mark.parametrize(
    "module",
    ["services.ingest.core", "services.scheduler.core", "services.scheduler.policies"],
)
def test_core_imports_no_infrastructure(module: str) -> None:
    code = (
        f"import {module}, sys; "
        f"print([m for m in {FORBIDDEN!r} if m in sys.modules])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"{module} imports {done.stdout.strip()}"


def test_ingest_core_imports_no_http_or_wire_models() -> None:
    code = (
        "import services.ingest.core, sys; "
        "print([m for m in ('httpx', 'fastapi', 'pydantic', 'yaml') if m in sys.modules])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
