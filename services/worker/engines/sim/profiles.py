"""Engine profiles shipped as data (``profiles.toml``) plus the loader for user profiles.

A profile file holds ``[profiles.NAME]`` tables; see the comments at the top of
``profiles.toml`` for the keys, their units and where the shipped numbers come from.
``load_profiles(extra)`` returns the shipped profiles, then those in ``extra``; a user
profile with a shipped name replaces it (recalibrating a model is the common reason).
Every value is checked and a bad one raises ``ValueError`` naming the file and key, e.g.
``profiles.foo.beta0_us must be > 0``: numbers must be finite and positive, ``block_size``
at most :data:`~services.worker.engines.sim.model.MAX_BLOCK_SIZE` tokens; unknown keys are
errors too, so typos do not pass silently as defaults. Files are UTF-8.
"""

from __future__ import annotations

import math
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Final

from services.worker.engines.sim.model import MAX_BLOCK_SIZE, EngineProfile

_US: Final = 1e-6
_REQUIRED_FLOATS: Final = (
    "beta0_us",
    "beta1_us_per_prefill_token",
    "beta2_us_per_decode_token",
)
_REQUIRED_INTS: Final = ("num_blocks", "kv_bytes_per_token")
_OPTIONAL_INTS: Final = {"block_size": 16, "max_num_seqs": 256, "max_num_batched_tokens": 8192}
_STRINGS: Final = ("model", "source")
_KNOWN: Final = frozenset((*_REQUIRED_FLOATS, *_REQUIRED_INTS, *_OPTIONAL_INTS, *_STRINGS))


def _number(where: str, raw: dict[str, Any], key: str) -> float:
    if key not in raw:
        raise ValueError(f"{where}.{key} is required")
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}.{key} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an integer past a float's range
        number = math.inf
    if not math.isfinite(number):  # TOML has inf and nan
        shown = repr(value) if len(repr(value)) <= 24 else f"{str(value)[:12]}... (too large)"
        raise ValueError(f"{where}.{key} must be a finite number, got {shown}")
    if not number > 0:
        raise ValueError(f"{where}.{key} must be > 0, got {value!r}")
    return number


def _integer(where: str, raw: dict[str, Any], key: str, default: int | None) -> int:
    if key not in raw:
        if default is None:
            raise ValueError(f"{where}.{key} is required")
        return default
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}.{key} must be an integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"{where}.{key} must be > 0, got {value!r}")
    return value


def _string(where: str, raw: dict[str, Any], key: str, default: str | None) -> str:
    if key not in raw:
        if default is None:
            raise ValueError(f"{where}.{key} is required")
        return default
    value = raw[key]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}.{key} must be a non-empty string, got {value!r}")
    return value


def profile_from_table(name: str, raw: dict[str, Any]) -> EngineProfile:
    """Validate one ``[profiles.NAME]`` table and build its profile."""
    where = f"profiles.{name}"
    unknown = sorted(set(raw) - _KNOWN)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}")
    beta0, beta1, beta2 = (_number(where, raw, k) for k in _REQUIRED_FLOATS)
    if beta0 < 0.001:
        raise ValueError(f"{where}.beta0_us must be >= 0.001 (one nanosecond)")
    ints = {k: _integer(where, raw, k, None) for k in _REQUIRED_INTS}
    ints |= {k: _integer(where, raw, k, d) for k, d in _OPTIONAL_INTS.items()}
    if ints["block_size"] > MAX_BLOCK_SIZE:
        raise ValueError(
            f"{where}.block_size must be <= {MAX_BLOCK_SIZE} tokens, got "
            f"{ints['block_size']} (vLLM's blocks are 1 to 256 tokens, 16 by default)"
        )
    if ints["max_num_batched_tokens"] < ints["max_num_seqs"]:
        raise ValueError(f"{where}.max_num_batched_tokens must be >= max_num_seqs")
    return EngineProfile(
        name=name,
        beta0_s=beta0 * _US,
        beta1_s_per_prefill_tok=beta1 * _US,
        beta2_s_per_decode_tok=beta2 * _US,
        num_blocks=ints["num_blocks"],
        block_size=ints["block_size"],
        max_num_seqs=ints["max_num_seqs"],
        max_num_batched_tokens=ints["max_num_batched_tokens"],
        kv_bytes_per_token=ints["kv_bytes_per_token"],
        model=_string(where, raw, "model", name),
        source=_string(where, raw, "source", None),
    )


def parse_profiles(text: str, origin: str) -> dict[str, EngineProfile]:
    """Profiles in one TOML document; ``origin`` names it in error messages."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{origin}: not valid TOML: {exc}") from exc
    tables = doc.get("profiles")
    if not isinstance(tables, dict) or not tables:
        raise ValueError(f"{origin}: expected one or more [profiles.NAME] tables")
    out: dict[str, EngineProfile] = {}
    for name, raw in tables.items():
        if not isinstance(raw, dict):
            raise ValueError(f"{origin}: profiles.{name} must be a table")
        try:
            out[name] = profile_from_table(name, raw)
        except ValueError as exc:
            raise ValueError(f"{origin}: {exc}") from None
    return out


def shipped_profiles() -> dict[str, EngineProfile]:
    text = resources.files(__package__).joinpath("profiles.toml").read_text("utf-8")
    return parse_profiles(text, "profiles.toml (shipped)")


def load_profiles(extra_path: Path | None = None) -> dict[str, EngineProfile]:
    """Shipped profiles, then the ones in ``extra_path`` (which win on a name clash)."""
    profiles = shipped_profiles()
    if extra_path is not None:
        profiles |= parse_profiles(_read_utf8(extra_path), str(extra_path))
    return profiles


def _read_utf8(path: Path) -> str:
    """The text of ``path``; ``ValueError`` naming the file and line if it is not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x}); TOML files "
            "must be UTF-8"
        ) from None


def get_profile(name: str, extra_path: Path | None = None) -> EngineProfile:
    """One profile by name; ``ValueError`` listing the known names if it is missing."""
    profiles = load_profiles(extra_path)
    if name not in profiles:
        raise ValueError(f"unknown engine profile {name!r}; known: {', '.join(sorted(profiles))}")
    return profiles[name]
