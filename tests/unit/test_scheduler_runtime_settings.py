"""SchedulerSettings: LLMQ_SCHEDULER_* and LLMQ_METRICS_PORT, turned into the core's config."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.common.settings import PROJECT_ROOT
from services.scheduler import DEFAULT_PROFILE, ConfigError, build_pipeline
from services.scheduler.settings import SchedulerSettings, read_profile_file


def test_environment_and_aliases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMQ_SCHEDULER_MAX_PENDING", "42")
    monkeypatch.setenv("LLMQ_SCHEDULER_SHORT_WEIGHT", "5")
    monkeypatch.setenv("LLMQ_METRICS_PORT", "9400")
    settings = SchedulerSettings()
    assert settings.max_pending == 42 and settings.metrics_port == 9400
    queue = settings.queue_config()
    assert queue.max_pending == 42 and queue.lane_weights == {"short": 5.0, "long": 1.0}
    assert settings.profile() is DEFAULT_PROFILE


def test_default_id_is_a_valid_stable_name() -> None:
    first = SchedulerSettings().resolved_scheduler_id()
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", first)
    assert SchedulerSettings().resolved_scheduler_id() == first
    assert SchedulerSettings(scheduler_id="s-1").resolved_scheduler_id() == "s-1"


@pytest.mark.parametrize(
    "field", [{"max_pending": 0}, {"pause_band": 1.0}, {"scheduler_id": "bad id"},
              {"kv_safety_margin": 1.0}, {"log_level": "loud"}],
)
def test_bounds_are_checked(field: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        SchedulerSettings(**field)  # type: ignore[arg-type]  # the wrong values are the test


def test_profile_file(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('picker = "least-requests"\ncandidates = 0\n[scorers]\n')
    build_pipeline(SchedulerSettings(profile_file=good).profile())
    bad = tmp_path / "bad.toml"
    bad.write_text('filters = ["model-match"]\n')
    with pytest.raises(ConfigError):
        build_pipeline(SchedulerSettings(profile_file=bad).profile())


def test_the_profiles_shipped_in_infra_are_valid() -> None:
    """What docs/benchmarks.md and the README tell operators to run must start."""
    shipped = sorted((PROJECT_ROOT / "infra" / "profiles").glob("*.toml"))
    assert shipped, "infra/profiles/ has no profile"
    for path in shipped:
        pipeline = build_pipeline(SchedulerSettings(profile_file=path).profile())
        assert pipeline.profile.filters  # the defaults fill in what the file leaves out
    no_overflow = PROJECT_ROOT / "infra" / "profiles" / "pd-no-overflow.toml"
    assert build_pipeline(read_profile_file(no_overflow)).pd_overflow_tokens == 0
