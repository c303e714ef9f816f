"""Profiles, the registry and pipeline building; bad config names its setting."""

from __future__ import annotations

import math
from typing import Any

import pytest

from services.scheduler import (
    BASELINE_PROFILES,
    DEFAULT_PROFILE,
    REGISTRY,
    REQUIRED_FILTERS,
    ConfigError,
    Filter,
    Picker,
    PlacementContext,
    Profile,
    QueuedRequest,
    Scorer,
    WorkerState,
    build_pipeline,
)
from services.scheduler.policies.profile import SpillRule

FILTERS = list(REQUIRED_FILTERS)


def test_default_profile_builds_llmq_choice() -> None:
    pipeline = build_pipeline()
    assert [f.name for f in pipeline.route_filters] == FILTERS[:4]
    assert [f.name for f in pipeline.index_filters] == FILTERS[4:]
    assert [f.name for f in pipeline.room_filters] == ["class-reserve"]
    weights = {s.name: w for s, w in pipeline.scorers}
    assert weights == pytest.approx(
        {
            "kv-headroom": 2 / 4.5,
            "queue-depth": 1 / 4.5,
            "prefix-affinity": 1 / 4.5,
            "throughput": 0.5 / 4.5,
        }
    )
    assert pipeline.picker.name == "max-score" and pipeline.candidates == 8
    assert build_pipeline(DEFAULT_PROFILE).profile == pipeline.profile


@pytest.mark.parametrize("name", sorted(BASELINE_PROFILES))
def test_baseline_profiles_build(name: str) -> None:
    pipeline = build_pipeline(BASELINE_PROFILES[name])
    assert pipeline.picker.name == name and pipeline.candidates == 0 and pipeline.scorers == ()


def test_missing_keys_take_defaults_and_zero_weights_drop_out() -> None:
    pipeline = build_pipeline({"scorers": {"kv-headroom": 1, "throughput": 0}})
    assert [(s.name, w) for s, w in pipeline.scorers] == [("kv-headroom", 1.0)]
    assert len(pipeline.route_filters) == 4


def test_every_registered_plugin_is_a_known_kind() -> None:
    for name, factory in REGISTRY.items():
        plugin = factory({})
        assert isinstance(plugin, Filter | Scorer | Picker), name
        assert plugin.name == name


def test_profile_is_a_plain_value() -> None:
    profile = Profile.from_mapping({"picker": "random", "candidates": 0})
    assert profile.picker == "random" and profile.filters == (*REQUIRED_FILTERS, "class-reserve")
    assert build_pipeline(profile).profile is profile


@pytest.mark.parametrize(
    ("profile", "setting"),
    [
        ({"pickr": "max-score"}, "pickr"),
        ({"picker": "best"}, "picker"),
        ({"picker": "kv-fits"}, "picker"),
        ({"picker": 3}, "picker"),
        ({"filters": "kv-fits"}, "filters"),
        ({"filters": [*FILTERS, "nope"]}, "filters[6]"),
        ({"filters": [*FILTERS, "kv-headroom"]}, "filters[6]"),
        ({"filters": [*FILTERS, "kv-fits"]}, "filters[6]"),
        ({"filters": FILTERS[:-1]}, "filters"),
        ({"scorers": {"kv-headroom": -1.0}}, "scorers.kv-headroom"),
        ({"scorers": {"kv-headroom": float("inf")}}, "scorers.kv-headroom"),
        ({"scorers": {"kv-headroom": True}}, "scorers.kv-headroom"),
        ({"scorers": {"kv-headroom": "2"}}, "scorers.kv-headroom"),
        ({"scorers": {"fastest": 1.0}}, "scorers.fastest"),
        ({"scorers": {"kv-fits": 1.0}}, "scorers.kv-fits"),
        ({"scorers": ["kv-headroom"]}, "scorers"),
        ({"scorers": {"kv-headroom": 0.0}}, "scorers"),  # max-score needs some weight
        ({"candidates": -1}, "candidates"),
        ({"candidates": 2.5}, "candidates"),
        ({"candidates": True}, "candidates"),
        ({"params": {"max-score": {"tie_epsilon": 0.7}}}, "params.max-score.tie_epsilon"),
        ({"params": {"max-score": {"tie_epsilon": "x"}}}, "params.max-score.tie_epsilon"),
        ({"params": {"max-score": {"tie": 0.1}}}, "params.max-score.tie"),
        ({"params": {"fresh-heartbeat": {"max_age_s": 0}}}, "params.fresh-heartbeat.max_age_s"),
        ({"params": {"kv-fits": {"slack": 1}}}, "params.kv-fits.slack"),
        ({"params": {"random": {}}}, "params.random"),  # not used by this profile
        ({"params": {"nope": {}}}, "params.nope"),
        ({"params": {"max-score": 1}}, "params.max-score"),
        ({"params": []}, "params"),
    ],
)
def test_bad_profiles_name_the_setting(profile: dict[str, Any], setting: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build_pipeline(profile)
    assert caught.value.setting == setting
    assert isinstance(caught.value, ValueError) and setting in str(caught.value)


def test_a_default_profile_value_equals_the_default_mapping() -> None:
    assert Profile() == Profile.from_mapping(DEFAULT_PROFILE)
    assert build_pipeline(Profile()).picker.name == "max-score"


class _Pretender:
    """A third-party filter that claims the index enforces its rule."""

    name = "pretender"
    stage = "index"

    def accepts(self, worker: WorkerState, request: QueuedRequest, ctx: PlacementContext) -> bool:
        return False


def test_only_the_core_capacity_filters_may_claim_the_index_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(REGISTRY, "pretender", lambda params: _Pretender())
    with pytest.raises(ConfigError) as caught:
        build_pipeline({"filters": [*FILTERS, "pretender"]})
    assert caught.value.setting == "filters[6]"


def test_a_profile_built_by_hand_is_checked_like_one_from_a_file() -> None:
    with pytest.raises(ConfigError, match="filters"):
        build_pipeline(Profile(filters=("model-match",)))  # the capacity filters dropped
    with pytest.raises(ConfigError, match=r"scorers\.kv-headroom"):
        build_pipeline(Profile(scorers=(("kv-headroom", math.nan),)))
    with pytest.raises(ConfigError, match="candidates"):
        build_pipeline(Profile(candidates=-5))
    with pytest.raises(ConfigError, match=r"spill\.long"):
        build_pipeline(Profile(spill={"long": SpillRule(after_s=-1.0)}))


def test_weights_whose_sum_overflows_are_refused() -> None:
    with pytest.raises(ConfigError, match="scorers"):
        build_pipeline({"scorers": {"kv-headroom": 1e308, "queue-depth": 1e308}})
