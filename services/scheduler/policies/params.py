"""Reading plugin parameters from a profile, with errors that name the setting."""

from __future__ import annotations

import math
from collections.abc import Collection

from services.scheduler.core.errors import ConfigError
from services.scheduler.policies.base import Params


def only(params: Params, plugin: str, allowed: Collection[str] = ()) -> None:
    """Raise for any parameter of ``plugin`` not in ``allowed``."""
    for key in params:
        if key not in allowed:
            raise ConfigError(f"params.{plugin}.{key}", "unknown parameter")


def number(
    params: Params,
    plugin: str,
    key: str,
    default: float,
    *,
    low: float,
    high: float,
    low_open: bool = False,
) -> float:
    """A finite number in [low, high] (or (low, high] when ``low_open``)."""
    value = params.get(key, default)
    setting = f"params.{plugin}.{key}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(setting, f"must be a number, got {value!r}")
    bracket = "(" if low_open else "["
    inside = (value > low if low_open else value >= low) and value <= high
    if not math.isfinite(value) or not inside:
        raise ConfigError(setting, f"must be in {bracket}{low}, {high}], got {value!r}")
    return float(value)
