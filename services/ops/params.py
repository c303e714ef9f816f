"""Click parameter types the ``llmq`` commands share (services/cli.py, services/ops, the
dev tools): numbers that must be finite and within bounds, refused as usage errors (exit 2)
before anything is sent or started."""

from __future__ import annotations

import math
from typing import Any

import click


class FiniteFloatRange(click.FloatRange):
    """``click.FloatRange`` with both bounds required, which also refuses ``nan``.

    ``nan`` compares false with every bound, so a plain ``FloatRange`` lets it through (a
    ``--timeout nan`` would wait forever); a finite ``max`` refuses ``inf``.
    """

    def __init__(self, min: float, max: float, *, min_open: bool = False,
                 max_open: bool = False) -> None:
        super().__init__(min, max, min_open=min_open, max_open=max_open)

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if math.isnan(number):
            self.fail(f"{value!r} is not a number.", param, ctx)
        return number


def seconds(max_s: float) -> FiniteFloatRange:
    """A duration in seconds: more than 0, at most ``max_s``."""
    return FiniteFloatRange(0, max_s, min_open=True)


#: A TCP port number.
PORT = click.IntRange(1, 65_535)
