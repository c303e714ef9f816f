"""The scheduler's core and policies stay pure: no I/O stacks, clocks or env reads."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "services" / "scheduler"
PURE = sorted([*ROOT.glob("core/*.py"), *ROOT.glob("policies/**/*.py")])
FORBIDDEN = {
    "faust",
    "aiokafka",
    "consul",
    "vllm",
    "pynvml",
    "pydantic",
    "pydantic_settings",
    "os",
    "time",
    "datetime",
    "socket",
    "asyncio",
    "httpx",
    "requests",
    "schemas.messages",
}


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_there_are_pure_modules_to_check() -> None:
    assert len(PURE) > 20


@pytest.mark.parametrize("path", PURE, ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_module_imports(path: Path) -> None:
    for name in imported(path):
        top = name.split(".")[0]
        assert top not in FORBIDDEN and name not in FORBIDDEN, f"{path.name} imports {name}"
        if top == "schemas":
            assert name == "schemas.common", f"{path.name} imports wire models from {name}"
