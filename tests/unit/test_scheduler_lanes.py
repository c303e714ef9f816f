"""Weighted lane turns on pool-any workers (core.lanes)."""

from __future__ import annotations

import pytest

from schemas.common import Lane
from services.scheduler import LaneInterleave

BOTH: tuple[Lane, ...] = ("short", "long")
ONLY_SHORT: tuple[Lane, ...] = ("short",)


def _turns(lanes: LaneInterleave, n: int, ready: tuple[Lane, ...] = ("short", "long")) -> str:
    out = []
    for _ in range(n):
        lane = lanes.next_lane(ready)
        assert lane is not None
        lanes.charge(lane)
        out.append(lane[0].upper())
    return "".join(out)


@pytest.mark.parametrize(
    ("weights", "turns"),
    [
        ({"short": 3.0, "long": 1.0}, "SLSSSLSSSL"),
        ({"short": 1.0, "long": 1.0}, "SLSLSLSLSL"),
        ({"short": 1.0, "long": 2.0}, "SLLSLLSLLS"),
    ],
)
def test_turns_follow_the_weights(weights: dict[Lane, float], turns: str) -> None:
    assert _turns(LaneInterleave(weights), 10) == turns


def test_only_ready_lanes_get_turns() -> None:
    lanes = LaneInterleave()
    assert _turns(lanes, 4, ("long",)) == "LLLL"
    assert lanes.next_lane(()) is None


def test_an_idle_lane_cannot_hoard_credit() -> None:
    lanes = LaneInterleave()
    _turns(lanes, 100, ("short",))  # long had nothing to place for a long time
    burst = _turns(lanes, 8)
    assert burst.count("L") <= 3  # not a run of dozens of long turns
    assert burst.startswith("L")


def test_a_dedicated_placement_costs_no_turn_but_yields_one() -> None:
    lanes = LaneInterleave()
    lanes.charge("long")  # long is a full step ahead on the shared pool
    assert lanes.next_lane(BOTH) == "short"
    lanes.charge("short", shared=False)  # went to a short-pool worker: no cost...
    assert lanes.virtual_times() == {"short": 0.0, "long": 1.0}
    assert lanes.next_lane(BOTH) == "long"  # ... but long gets a look
    assert lanes.next_lane(ONLY_SHORT) == "short"
    lanes.charge("long", shared=False)
    assert lanes.next_lane(BOTH) == "short"
