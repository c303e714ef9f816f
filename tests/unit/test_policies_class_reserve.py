"""Filter ``class-reserve``: the last slots and KV of a busy worker are for the high class."""

from __future__ import annotations

import pytest

from services.scheduler import (
    DEFAULT_PROFILE,
    ConfigError,
    Ledger,
    Placement,
    PlacementContext,
    Snapshot,
    build_pipeline,
    schedule,
)
from services.scheduler.policies.filters.class_reserve import ClassReserve, factory
from tests.builders import NOW, make_queue, make_request, make_worker, seeded


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


@pytest.mark.parametrize(("waited_s", "accepted"), [(59.0, False), (60.0, True)])
def test_a_request_aged_into_the_high_class_may_take_the_reserve(
    waited_s: float, accepted: bool
) -> None:
    # A low request reaches the high class after its aging bound (2 × 30 s): the reserve
    # is the high class's, so it is that request's too (as the engine ranks it: priority 0).
    worker = make_worker(kv_total_tokens=10_000, kv_free_tokens=9_000, running=56,
                         max_num_seqs=64)  # 56 + 1 + 8 > 64: only the reserve is left
    request = make_request("old", priority="low", kv_tokens=1_000, enqueued_at=NOW - waited_s)
    queue = make_queue()
    ctx = PlacementContext(Snapshot.of([worker], NOW), Ledger(kv_safety_margin=0.0), NOW,
                           queue.engine_priority)
    assert ctx.class_rank(request) == (0 if accepted else 1)
    assert ClassReserve(seqs=8, kv_fraction=0.05).accepts(worker, request, ctx) is accepted


def test_through_the_cycle_an_aged_request_does_not_block_a_fresh_high_one() -> None:
    # Only the reserve is left on the one worker; the low request has waited 10 minutes,
    # so it goes first (aged far past the fresh high one) and takes the reserve; before,
    # it was refused, held the worker, and kept the high one out too.
    worker = make_worker("w", max_num_seqs=16, running=12)
    queue = make_queue(make_request("old-low", priority="low", enqueued_at=NOW - 600),
                       make_request("new-high", priority="high", enqueued_at=NOW))
    decisions = schedule(Snapshot.of([worker], NOW), queue, Ledger(),
                         build_pipeline(DEFAULT_PROFILE), NOW, seeded())
    assert [d.request.request_id for d in decisions if isinstance(d, Placement)] == [
        "old-low", "new-high"]


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
