"""Filter ``class-reserve``: the last slots and KV of a busy worker are for the high class."""

from __future__ import annotations

import pytest

from services.scheduler import ConfigError, Ledger, PlacementContext, Snapshot, build_pipeline
from services.scheduler.policies.filters.class_reserve import ClassReserve, factory
from tests.builders import NOW, make_request, make_worker


def accepts(running: int, free: int, priority: str = "normal", kv: int = 1_000,
            max_num_seqs: int = 64) -> bool:
    """10,000 usable tokens (margin 0), ``free`` of them free, ``running`` in flight."""
    worker = make_worker(kv_total_tokens=10_000, kv_free_tokens=free, running=running,
                         max_num_seqs=max_num_seqs)
    ledger = Ledger(kv_safety_margin=0.0)
    ctx = PlacementContext(Snapshot.of([worker], NOW), ledger, NOW)
    request = make_request("r", priority=priority, kv_tokens=kv)  # type: ignore[arg-type]
    return ClassReserve(seqs=8, kv_fraction=0.05).accepts(worker, request, ctx)


@pytest.mark.parametrize(
    ("running", "free", "priority", "kv", "max_num_seqs", "accepted"),
    [
        (10, 9_000, "normal", 1_000, 64, True),  # plenty of room
        (55, 9_000, "normal", 1_000, 64, True),  # 55 + 1 + 8 = 64 slots: the last one allowed
        (56, 9_000, "normal", 1_000, 64, False),  # would eat into the 8 kept slots
        (56, 9_000, "high", 1_000, 64, True),  # ... which are the high class's
        (10, 1_500, "normal", 1_000, 64, True),  # 1,000 + 500 kept = 1,500 free
        (10, 1_499, "normal", 1_000, 64, False),  # one token short of the kept 5 %
        (10, 1_499, "low", 1_000, 64, False),
        (10, 1_000, "high", 1_000, 64, True),
        (0, 1_000, "normal", 1_000, 64, True),  # an idle worker takes anyone that fits
        (2, 9_000, "normal", 1_000, 4, True),  # 4 slots: keeps min(8, 4 // 4) = 1
        (3, 9_000, "normal", 1_000, 4, False),
    ],
)
def test_the_reserve(running: int, free: int, priority: str, kv: int, max_num_seqs: int,
                     accepted: bool) -> None:
    assert accepts(running, free, priority, kv, max_num_seqs) is accepted


def test_it_is_in_the_default_profile_and_configurable() -> None:
    pipeline = build_pipeline({"params": {"class-reserve": {"seqs": 3, "kv_fraction": 0.1}}})
    (reserve,) = pipeline.room_filters
    assert isinstance(reserve, ClassReserve) and (reserve.seqs, reserve.kv_fraction) == (3, 0.1)
    assert build_pipeline({"filters": ["model-match", "lane-pool", "fresh-heartbeat",
                                       "not-draining", "kv-fits", "seq-slots"]}).room_filters == ()


@pytest.mark.parametrize(
    ("params", "setting"),
    [
        ({"seqs": 1.5}, "params.class-reserve.seqs"),
        ({"seqs": -1}, "params.class-reserve.seqs"),
        ({"kv_fraction": 0.9}, "params.class-reserve.kv_fraction"),
        ({"share": 0.1}, "params.class-reserve.share"),
    ],
)
def test_bad_parameters_name_the_setting(params: dict[str, object], setting: str) -> None:
    with pytest.raises(ConfigError) as caught:
        factory(params)
    assert caught.value.setting == setting
