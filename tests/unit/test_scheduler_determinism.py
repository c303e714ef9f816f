"""The same inputs and seed give the same decisions in every process: nothing in the cycle
may depend on the order of a set of strings, which changes with PYTHONHASHSEED."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

from services.scheduler import DEFAULT_PROFILE, Ledger, Placement, build_pipeline, schedule
from tests.builders import make_queue, make_request, make_snapshot, make_worker

ROOT = Path(__file__).resolve().parents[2]


def hold_ends_with_two_tied_heads_behind_it() -> str:
    """A hold ends mid-cycle while two tied heads of different classes wait behind it,
    room for one: the decisions, as one line."""
    pipeline = build_pipeline(DEFAULT_PROFILE)
    ledger = Ledger(kv_safety_margin=0.0)
    worker = make_worker("W1", kv_total_tokens=100_000, heartbeat_ts=100.0)
    assert ledger.reserve(worker, make_request("filler", kv_tokens=90_000, priority="high"))
    queue = make_queue(make_request("V", priority="low", lane="long", kv_tokens=50_000,
                                    enqueued_at=0.0))
    # V is overdue (the low class's bound is 60 s) and blocked: it holds W1.
    schedule(make_snapshot([worker], now=100.0), queue, ledger, pipeline, 100.0,
             random.Random(1))
    assert ledger.holder("W1") == "V"
    ledger.release("filler", 0)
    queue.push(make_request("A", priority="normal", kv_tokens=30_000, enqueued_at=99.0))
    queue.push(make_request("B", priority="normal", kv_tokens=30_000, enqueued_at=99.0,
                            model_version="v1"))  # another class, tied with A
    decisions = schedule(make_snapshot([worker], now=100.5), queue, ledger, pipeline, 100.5,
                         random.Random(1))
    return " ".join(
        f"{type(d).__name__}:{d.request.request_id if isinstance(d, Placement) else d.request_id}"
        for d in decisions)


def test_a_hold_ending_mid_cycle_decides_the_same_under_every_hash_seed() -> None:
    here = hold_ends_with_two_tied_heads_behind_it()
    assert here.startswith("Placement:V ")
    code = ("from tests.unit.test_scheduler_determinism import "
            "hold_ends_with_two_tied_heads_behind_it as run; print(run())")
    seen = set()
    for seed in range(8):
        env = {**os.environ, "PYTHONHASHSEED": str(seed)}
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                             capture_output=True, text=True, check=True, timeout=120)
        seen.add(out.stdout.strip())
    assert seen == {here}
