"""Small validators shared by the ``from_mapping`` constructors.

Config arrives as plain dicts (parsed TOML/YAML); each validator takes the value and the
dotted name of the setting and either returns a typed value or raises
:class:`~services.ingest.core.errors.ConfigError` naming that setting.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from schemas.common import PRIORITIES, Priority
from services.ingest.core.errors import ConfigError

_PRIORITY_BY_NAME: dict[object, Priority] = {p: p for p in PRIORITIES}


def positive_int(value: object, setting: str) -> int:
    """An ``int`` > 0 (``bool`` is refused: ``True`` is not a layer count)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(setting, f"must be a positive integer, got {value!r}")
    if value <= 0:
        raise ConfigError(setting, f"must be > 0, got {value}")
    return value


def positive_float(value: object, setting: str, *, upper: float = math.inf) -> float:
    """A finite number in (0, upper]."""
    number = _finite(value, setting)
    if not 0.0 < number <= upper:
        raise ConfigError(setting, f"must be in (0, {upper}], got {number}")
    return number


def non_negative_float(value: object, setting: str) -> float:
    """A finite number ≥ 0."""
    number = _finite(value, setting)
    if number < 0.0:
        raise ConfigError(setting, f"must be >= 0, got {number}")
    return number


def boolean(value: object, setting: str) -> bool:
    """A real ``bool`` (YAML ``yes``/``no`` parse to bool; the string ``"false"`` is refused)."""
    if not isinstance(value, bool):
        raise ConfigError(setting, f"must be true or false, got {value!r}")
    return value


def string(value: object, setting: str) -> str:
    """A non-empty string."""
    if not isinstance(value, str) or not value:
        raise ConfigError(setting, f"must be a non-empty string, got {value!r}")
    return value


def strings(value: object, setting: str) -> tuple[str, ...]:
    """A list of non-empty strings (a bare string is refused: it would iterate by char)."""
    if isinstance(value, str | Mapping) or not isinstance(value, Iterable):
        raise ConfigError(setting, f"must be a list of strings, got {value!r}")
    return tuple(string(item, f"{setting}[{i}]") for i, item in enumerate(value))


def priority(value: object, setting: str) -> Priority:
    """One of ``high``, ``normal``, ``low``."""
    found = _PRIORITY_BY_NAME.get(value) if isinstance(value, str) else None
    if found is None:
        raise ConfigError(setting, f"must be one of {', '.join(PRIORITIES)}, got {value!r}")
    return found


def section(value: object, setting: str) -> Mapping[str, object]:
    """A mapping with string keys."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(setting, f"must be a table of settings, got {value!r}")
    return value


def known_keys(mapping: Mapping[str, object], allowed: Iterable[str], prefix: str) -> None:
    """Refuse keys not in ``allowed``: a typo must not silently fall back to a default."""
    unknown = sorted(set(mapping) - set(allowed))
    if unknown:
        raise ConfigError(_join(prefix, unknown[0]), "unknown setting")


def required(mapping: Mapping[str, object], key: str, prefix: str) -> object:
    """``mapping[key]``, or a ConfigError naming ``prefix.key`` when it is absent."""
    if key not in mapping:
        raise ConfigError(_join(prefix, key), "required setting is missing")
    return mapping[key]


def _finite(value: object, setting: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(setting, f"must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an integer of hundreds of digits
        raise ConfigError(setting, "must be finite, got an integer too large for a "
                                   "float") from None
    if not math.isfinite(number):
        raise ConfigError(setting, f"must be finite, got {number}")
    return number


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key
