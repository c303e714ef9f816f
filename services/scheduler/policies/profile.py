"""Profiles: which plugins a placement pipeline runs, with what weights, validated.

A profile is a plain mapping (parsed TOML/YAML or a literal)::

    filters = ["model-match", "lane-pool", "fresh-heartbeat", "not-draining", "kv-fits",
               "seq-slots", "class-reserve"]
    picker = "max-score"
    candidates = 8            # roomiest workers scored per decision; 0 = every feasible one
    pd_overflow_tokens = 131072   # prefill/decode fleets only, see below; 0 = never
    [scorers]                 # name = weight >= 0; combined as a weighted mean
    kv-headroom = 2.0
    queue-depth = 1.0
    throughput = 0.5
    prefix-affinity = 1.0
    [params.max-score]        # optional per-plugin parameters
    tie_epsilon = 1e-9
    [spill.short]             # short requests may borrow long-pool workers ...
    after_s = 0.0             # ... at once (seconds waited first)
    max_per_worker = 0        # ... any number per worker (0 = no bound)
    [spill.long]              # long requests may borrow short-pool workers ...
    after_s = 10.0            # ... after waiting 10 s
    max_per_worker = 1        # ... one borrowed long request per short worker at a time

Missing keys take the values of :data:`DEFAULT_PROFILE`. The first six filters above are
required: they are the capacity and liveness guarantees (never overcommit, stale = full,
drain takes nothing new), so a profile may add filters but not drop these. Anything wrong
raises :class:`ConfigError` naming the setting.

``spill`` makes dedicated pools work-conserving across lanes (see :mod:`..core.cycle`,
"Spill"). A request of lane L that fits no worker of its own route may be placed on a
worker of the *other* dedicated pool when (1) no request of the other lane for its model
is pending — the borrowed worker's own lane is empty, so nothing is taken from it — (2) it
has waited at least ``spill.L.after_s``, and (3) that worker holds fewer than
``spill.L.max_per_worker`` reservations of lane L (0: no bound). A lane missing from the
table never spills; ``spill = {}`` turns it off. Holds and every filter still apply.
Defaults (:data:`DEFAULT_SPILL`): short requests borrow long workers at once and without
bound (they are small and short-lived); long requests borrow a short worker only after
10 s and one at a time, because each long prefill stretches the short decodes sharing its
engine steps.

``pd_overflow_tokens`` matters only on a fleet with ``prefill`` and ``decode`` workers
(:mod:`..core.cycle`, "Prefill and decode apart"): when every prefill worker of a route
has at least this many prompt tokens placed and not yet computed, a long request goes
whole to a decode worker that has no prompt of its own to compute (Splitwise's mixed
pool, one simple form). The default, 131,072 tokens, is about 2.3 s of prefill on an
H100 (docs/benchmarks.md, "Thirteenth round").

``candidates`` bounds the work per decision: scoring every one of 1,000 workers in Python
costs ~100 µs or more, so llmq scores the K workers with the most room (plus the
prefix-affinity worker). Baseline pickers use ``candidates = 0`` to see every feasible
worker, at O(fleet) per decision.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from schemas.common import LANES, Lane
from services.scheduler.core.errors import ConfigError
from services.scheduler.policies.base import Filter, Picker, RoomFilter, Scorer
from services.scheduler.policies.filters.kv_fits import KvFits
from services.scheduler.policies.filters.seq_slots import SeqSlots
from services.scheduler.policies.registry import REGISTRY

REQUIRED_FILTERS: Final = (
    "model-match",
    "lane-pool",
    "fresh-heartbeat",
    "not-draining",
    "kv-fits",
    "seq-slots",
)

#: The required filters, then the high class's reserve (filters/class_reserve.py).
DEFAULT_FILTERS: Final = (*REQUIRED_FILTERS, "class-reserve")

#: llmq's choice: headroom first (slack for decode growth, few preemptions), then short
#: queues, then prefix-cache reuse, with throughput as a tie-breaker between equals.
DEFAULT_SCORERS: Final = (
    ("kv-headroom", 2.0),
    ("queue-depth", 1.0),
    ("prefix-affinity", 1.0),
    ("throughput", 0.5),
)
DEFAULT_CANDIDATES: Final = 8
DEFAULT_PD_OVERFLOW_TOKENS: Final = 131_072


@dataclass(frozen=True, slots=True)
class SpillRule:
    """When a request of one lane may borrow a worker of the other lane's pool."""

    after_s: float = 0.0
    max_per_worker: int = 0  # reservations of the borrowing lane per worker; 0 = no bound


DEFAULT_SPILL: Final[Mapping[Lane, SpillRule]] = MappingProxyType(
    {"short": SpillRule(0.0, 0), "long": SpillRule(10.0, 1)}
)

DEFAULT_PROFILE: Final[Mapping[str, object]] = MappingProxyType(
    {
        "filters": list(DEFAULT_FILTERS),
        "scorers": dict(DEFAULT_SCORERS),
        "picker": "max-score",
        "candidates": DEFAULT_CANDIDATES,
        "spill": {
            lane: {"after_s": rule.after_s, "max_per_worker": rule.max_per_worker}
            for lane, rule in DEFAULT_SPILL.items()
        },
        "pd_overflow_tokens": DEFAULT_PD_OVERFLOW_TOKENS,
    }
)

#: Baselines for the simulator: same hard filters, scores ignored, every feasible worker.
BASELINE_PROFILES: Final[Mapping[str, Mapping[str, object]]] = MappingProxyType(
    {
        name: MappingProxyType(
            {"filters": list(REQUIRED_FILTERS), "scorers": {}, "picker": name, "candidates": 0}
        )
        for name in ("round-robin", "least-requests", "random")
    }
)

#: The filters whose rule the candidate index implements (``ledger.room() >= kv_tokens``).
INDEXED_FILTERS: Final = (KvFits, SeqSlots)

_KEYS: Final = frozenset(
    {"filters", "scorers", "picker", "candidates", "params", "spill", "pd_overflow_tokens"}
)
_MAX_CANDIDATES: Final = 100_000


@dataclass(frozen=True, slots=True)
class Profile:
    """A validated profile (names and numbers only; plugins are built by the pipeline)."""

    filters: tuple[str, ...] = DEFAULT_FILTERS
    scorers: tuple[tuple[str, float], ...] = DEFAULT_SCORERS
    picker: str = "max-score"
    candidates: int = DEFAULT_CANDIDATES
    params: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    spill: Mapping[Lane, SpillRule] = field(default_factory=lambda: dict(DEFAULT_SPILL))
    pd_overflow_tokens: int = DEFAULT_PD_OVERFLOW_TOKENS

    @classmethod
    def from_mapping(cls, raw: Mapping[str, object]) -> Profile:
        unknown = sorted(set(raw) - _KEYS)
        if unknown:
            raise ConfigError(unknown[0], f"unknown profile key (known: {sorted(_KEYS)})")
        merged = {**DEFAULT_PROFILE, **raw}
        return cls(
            filters=_filters(merged["filters"]),
            scorers=_scorers(merged["scorers"]),
            picker=_name(merged["picker"], "picker"),
            candidates=_candidates(merged["candidates"]),
            params=_params(merged.get("params", {})),
            spill=_spill(merged["spill"]),
            pd_overflow_tokens=_overflow(merged["pd_overflow_tokens"]),
        )


@dataclass(frozen=True, slots=True, eq=False)
class Pipeline:
    """Built plugins of a profile, split by stage; weights normalised to sum to 1.

    Hashable by identity: candidate indexes are memoised per pipeline.
    """

    profile: Profile
    route_filters: tuple[Filter, ...]
    index_filters: tuple[Filter, ...]
    room_filters: tuple[RoomFilter, ...]
    scorers: tuple[tuple[Scorer, float], ...]
    picker: Picker
    candidates: int
    spill: Mapping[Lane, SpillRule] = field(default_factory=dict)
    pd_overflow_tokens: int = 0
    #: The scorers' (normalised) weights alone, in their order: every decision reads them.
    weights: tuple[float, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", tuple(weight for _, weight in self.scorers))


def build_pipeline(profile: Mapping[str, object] | Profile = DEFAULT_PROFILE) -> Pipeline:
    """Validate ``profile`` and build its plugins from :data:`REGISTRY`."""
    if isinstance(profile, Profile):
        Profile.from_mapping(_as_mapping(profile))  # one built by hand: a file's checks
        prof = profile
    else:
        prof = Profile.from_mapping(profile)
    _check_names(prof)
    filters = [_build(name, prof, f"filters[{i}]") for i, name in enumerate(prof.filters)]
    scorers = [(_build(name, prof, f"scorers.{name}"), w) for name, w in prof.scorers]
    picker = _build(prof.picker, prof, "picker")
    checked_filters = [_as_filter(p, prof.filters[i], i) for i, p in enumerate(filters)]
    checked_scorers = [(_as_scorer(p, prof.scorers[i][0]), w) for i, (p, w) in enumerate(scorers)]
    if not isinstance(picker, Picker):
        raise ConfigError("picker", f"{prof.picker!r} is not a picker")
    total = sum(w for _, w in checked_scorers)
    if not math.isfinite(total):
        raise ConfigError("scorers", "the weights' sum overflows; use smaller weights (only "
                                     "their ratios matter)")
    if picker.uses_scores and total <= 0:
        raise ConfigError("scorers", f"picker {prof.picker!r} needs a positive total weight")
    return Pipeline(
        profile=prof,
        route_filters=tuple(f for f in checked_filters if f.stage == "route"),
        index_filters=tuple(f for f in checked_filters if f.stage == "index"),
        room_filters=tuple(f for f in checked_filters  # RoomFilter: checked by _as_filter
                           if f.stage == "room" and isinstance(f, RoomFilter)),
        scorers=tuple((s, w / total) for s, w in checked_scorers if w > 0),
        picker=picker,
        candidates=prof.candidates,
        spill=MappingProxyType(dict(prof.spill)),
        pd_overflow_tokens=prof.pd_overflow_tokens,
    )


# -- validation helpers -------------------------------------------------------------------


def _as_mapping(profile: Profile) -> dict[str, object]:
    """``profile`` as the mapping :meth:`Profile.from_mapping` reads."""
    return {
        "filters": list(profile.filters),
        "scorers": dict(profile.scorers),
        "picker": profile.picker,
        "candidates": profile.candidates,
        "params": {name: dict(p) for name, p in profile.params.items()},
        "spill": {lane: {"after_s": r.after_s, "max_per_worker": r.max_per_worker}
                  for lane, r in profile.spill.items()},
        "pd_overflow_tokens": profile.pd_overflow_tokens,
    }


def _name(value: object, setting: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(setting, f"must be a plugin name, got {value!r}")
    if value not in REGISTRY:
        raise ConfigError(setting, f"unknown plugin {value!r} (known: {sorted(REGISTRY)})")
    return value


def _filters(value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ConfigError("filters", f"must be a list of filter names, got {value!r}")
    names = tuple(_name(v, f"filters[{i}]") for i, v in enumerate(value))
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"filters[{i}]", f"{name!r} is listed twice")
    missing = [name for name in REQUIRED_FILTERS if name not in names]
    if missing:
        raise ConfigError("filters", f"must include {missing} (capacity and liveness guarantees)")
    return names


def _scorers(value: object) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, Mapping):
        raise ConfigError("scorers", f"must be a table of name = weight, got {value!r}")
    out: list[tuple[str, float]] = []
    for name, weight in value.items():
        setting = f"scorers.{name}"
        _name(name, setting)
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ConfigError(setting, f"weight must be a number, got {weight!r}")
        if not math.isfinite(weight) or weight < 0:
            raise ConfigError(setting, f"weight must be finite and >= 0, got {weight!r}")
        out.append((name, float(weight)))
    return tuple(out)


def _candidates(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError("candidates", f"must be an integer, got {value!r}")
    if not 0 <= value <= _MAX_CANDIDATES:
        raise ConfigError("candidates", f"must be in [0, {_MAX_CANDIDATES}], got {value}")
    return value


def _spill(value: object) -> dict[Lane, SpillRule]:
    if not isinstance(value, Mapping):
        raise ConfigError("spill", f"must be a table of lane = rule, got {value!r}")
    out: dict[Lane, SpillRule] = {}
    for lane, rule in value.items():
        setting = f"spill.{lane}"
        if lane not in LANES:
            raise ConfigError(setting, f"unknown lane {lane!r} (known: {list(LANES)})")
        if isinstance(rule, SpillRule):  # checked like a table
            rule = {"after_s": rule.after_s, "max_per_worker": rule.max_per_worker}
        if not isinstance(rule, Mapping):
            raise ConfigError(setting, f"must be a table, got {rule!r}")
        unknown = sorted(set(rule) - {"after_s", "max_per_worker"})
        if unknown:
            raise ConfigError(f"{setting}.{unknown[0]}", "unknown setting")
        after = rule.get("after_s", 0.0)
        if isinstance(after, bool) or not isinstance(after, int | float):
            raise ConfigError(f"{setting}.after_s", f"must be a number, got {after!r}")
        if not math.isfinite(after) or after < 0:
            raise ConfigError(f"{setting}.after_s", f"must be finite and >= 0, got {after!r}")
        bound = rule.get("max_per_worker", 0)
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
            raise ConfigError(f"{setting}.max_per_worker", f"must be an int >= 0, got {bound!r}")
        out[lane] = SpillRule(float(after), bound)
    return out


def _overflow(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError("pd_overflow_tokens", f"must be an int >= 0, got {value!r}")
    return value


def _params(value: object) -> Mapping[str, Mapping[str, object]]:
    if not isinstance(value, Mapping):
        raise ConfigError("params", f"must be a table of plugin tables, got {value!r}")
    out: dict[str, Mapping[str, object]] = {}
    for name, table in value.items():
        _name(name, f"params.{name}")
        if not isinstance(table, Mapping):
            raise ConfigError(f"params.{name}", f"must be a table, got {table!r}")
        out[str(name)] = dict(table)
    return out


def _check_names(prof: Profile) -> None:
    used = {*prof.filters, *(name for name, _ in prof.scorers), prof.picker}
    for name in prof.params:
        if name not in used:
            raise ConfigError(f"params.{name}", "parameters for a plugin the profile does not use")


def _build(name: str, prof: Profile, setting: str) -> object:
    if name not in REGISTRY:
        raise ConfigError(setting, f"unknown plugin {name!r}")
    return REGISTRY[name](prof.params.get(name, {}))


def _as_filter(plugin: object, name: str, i: int) -> Filter:
    if not isinstance(plugin, Filter):
        raise ConfigError(f"filters[{i}]", f"{name!r} is not a filter")
    if plugin.stage not in ("route", "index", "room"):
        raise ConfigError(f"filters[{i}]", f"{name!r} has unknown stage {plugin.stage!r}")
    if plugin.stage == "index" and not isinstance(plugin, INDEXED_FILTERS):
        raise ConfigError(
            f"filters[{i}]",
            f"{name!r} claims stage 'index', which only kv-fits and "
            "seq-slots may: the candidate index enforces exactly their rule",
        )
    if plugin.stage == "room" and not isinstance(plugin, RoomFilter):
        raise ConfigError(
            f"filters[{i}]",
            f"{name!r} has stage 'room' but no accepts_each: the cycle asks room filters "
            "about a batch of candidates at once",
        )
    return plugin


def _as_scorer(plugin: object, name: str) -> Scorer:
    if not isinstance(plugin, Scorer):
        raise ConfigError(f"scorers.{name}", f"{name!r} is not a scorer")
    return plugin
