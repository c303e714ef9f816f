"""bench_decide runs and reports its figures (timings themselves are not tested)."""

from __future__ import annotations

import pytest

from services.scheduler.bench import bench_decide


def test_bench_decide_runs_on_a_tiny_fleet() -> None:
    result = bench_decide(workers=4, pending=20, seed=3, repeats=20, warmup=2)
    assert {"placement_p50_us", "placement_p99_us", "workers", "pending"} <= set(result)
    assert result["workers"] == 4 and result["pending"] == 20
    assert result["repeats"] == 20


def test_bench_decide_rejects_nonsense_sizes() -> None:
    with pytest.raises(ValueError):
        bench_decide(workers=0)
