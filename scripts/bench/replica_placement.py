"""Placement latency of the live scheduler with one or several replicas.

A real Kafka broker (the one answering on ``LLMQ_KAFKA_*``, or the embedded one, started
and stopped here), real scheduler processes (``python -m services.scheduler``) in one
consumer group, and FAKE workers (the integration tests' ``FakeWorker``: heartbeats and
lifecycle events only, no engine). Two runs per replica count:

- **steady**: ``--requests`` high-class requests, one every ``--interval-s``, on
  ``--workers`` idle workers; the figure is each request's time from admission
  (``admitted_at``) to placement (the assignment's ``assigned_at``; one clock, this
  machine's), p50 / p90 / p99 / max;
- **burst**: ``--burst`` requests of 1,024 KV tokens at once on two workers of 3,800 usable
  tokens (three at a time each, 0.3 s apiece): the time until the last is placed, and how
  many placements went past a worker's usable KV (must be 0).

Usage (about 2 minutes per replica count)::

    .venv/bin/python scripts/bench/replica_placement.py --replicas 1,2 --json out.json

Figures from this script are in docs/live-system.md, "Several scheduler replicas".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services.common.kafka import broker_answers  # noqa: E402
from services.common.settings import Settings  # noqa: E402
from tests.integration import test_scheduler_service  # noqa: E402
from tests.integration.test_scheduler_service import (  # noqa: E402
    Cluster,
    FakeWorker,
    SchedulerProcess,
    eventually,
)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


#: Settings of every scheduler process (``--set`` adds to them).
ENV: dict[str, str] = {"LLMQ_SCHEDULER_HEARTBEAT_STALENESS": "10"}


async def _start(bootstrap: str, tmp: Path,
                 replicas: int) -> tuple[Cluster, list[SchedulerProcess]]:
    cluster = Cluster(bootstrap, f"bench{uuid.uuid4().hex[:8]}", tmp)
    env = dict(ENV)
    await cluster.start(**env)
    others = []
    for i in range(2, replicas + 1):
        other = SchedulerProcess(cluster.prefix, tmp / f"scheduler-{i}.log",
                                 env={**cluster.scheduler.env,
                                      "LLMQ_SCHEDULER_SCHEDULER_ID": f"sched-bench-{i}"})
        other.start()
        await other.wait_ready()
        others.append(other)
    if replicas > 1:
        for proc in (cluster.scheduler, *others):
            await eventually(lambda p=proc: f"{replicas} replica(s) in group" in p.tail(400),
                             timeout_s=60, what="every replica placing in turns")
    return cluster, others


async def _stop(cluster: Cluster, others: list[SchedulerProcess]) -> None:
    for other in others:
        other.kill(signal.SIGTERM)
    await cluster.stop()


async def _placed(cluster: Cluster, ids: list[str], timeout_s: float) -> dict[str, float]:
    """Each request's placement time (``assigned_at``) once all are placed."""
    await eventually(lambda: all(cluster.observer.assigned(r) for r in ids),
                     timeout_s=timeout_s, what="every request placed")
    return {a.request_id: a.assigned_at for _, a in cluster.observer.assignments
            if a.attempt == 1}


async def steady(bootstrap: str, tmp: Path, replicas: int, workers: int, requests: int,
                 interval_s: float) -> dict[str, Any]:
    cluster, others = await _start(bootstrap, tmp / "steady", replicas)
    try:
        for i in range(workers):
            await cluster.worker(f"fake-{i}", i, hold=False, run_s=0.05)
        await asyncio.sleep(2.0)  # every replica has seen every worker's heartbeat
        admitted: dict[str, float] = {}
        for i in range(requests):
            rid = f"s{i}"
            admitted[rid] = (await cluster.admit(rid, priority="high", prompt_tokens=200,
                                                 max_tokens=8)).admitted_at
            await asyncio.sleep(interval_s)
            if sys.stderr.isatty():
                print(f"\rsteady, {replicas} replica(s): {i + 1}/{requests}", end="",
                      file=sys.stderr, flush=True)
        if sys.stderr.isatty():
            print(file=sys.stderr)
        placed = await _placed(cluster, list(admitted), 60)
    finally:
        await _stop(cluster, others)
    waits = [(placed[r] - admitted[r]) * 1000.0 for r in admitted]
    return {"requests": len(waits), "p50_ms": _percentile(waits, 0.5),
            "p90_ms": _percentile(waits, 0.9), "p99_ms": _percentile(waits, 0.99),
            "max_ms": max(waits), "mean_ms": statistics.fmean(waits)}


async def burst(bootstrap: str, tmp: Path, replicas: int, size: int) -> dict[str, Any]:
    cluster, others = await _start(bootstrap, tmp / "burst", replicas)
    try:
        fakes: list[FakeWorker] = [
            await cluster.worker(f"fake-{i}", i, hold=False, run_s=0.3, kv_total_tokens=4_000)
            for i in range(2)]
        await asyncio.sleep(2.0)
        ids = [f"b{i}" for i in range(size)]
        began = time.time()
        await asyncio.gather(*(cluster.admit(r, prompt_tokens=1_000, max_tokens=24)
                               for r in ids))
        placed = await _placed(cluster, ids, 120)
    finally:
        await _stop(cluster, others)
    over = [v for w in fakes for v in w.violations if "duplicate" not in v]
    return {"requests": size, "last_placed_s": max(placed.values()) - began,
            "past_usable_kv": len(over)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    bootstrap = Settings().bootstrap
    out: dict[str, Any] = {"machine": f"{sys.platform}, {os.cpu_count()} cores",
                           "workers": args.workers, "interval_s": args.interval_s,
                           "settings": dict(ENV), "replicas": {}}
    with tempfile.TemporaryDirectory(prefix="llmq-bench-") as tmp:
        for n in args.replicas:
            root = Path(tmp) / f"r{n}"
            (root / "steady").mkdir(parents=True)
            (root / "burst").mkdir(parents=True)
            out["replicas"][str(n)] = {
                "steady": await steady(bootstrap, root, n, args.workers, args.requests,
                                       args.interval_s),
                "burst": await burst(bootstrap, root, n, args.burst),
            }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", default="1,2",
                        type=lambda s: [int(x) for x in s.split(",")],
                        help="replica counts to run, comma-separated (default: 1,2)")
    parser.add_argument("--workers", type=int, default=4,
                        help="idle FAKE workers in the steady run (default: 4)")
    parser.add_argument("--requests", type=int, default=300,
                        help="high-class requests in the steady run (default: 300)")
    parser.add_argument("--interval-s", type=float, default=0.2,
                        help="seconds between them (default: 0.2)")
    parser.add_argument("--burst", type=int, default=60,
                        help="requests in the burst (default: 60)")
    parser.add_argument("--set", metavar="NAME=VALUE", action="append", default=[],
                        help="a setting of every scheduler, e.g. LLMQ_SCHEDULER_TURN_SLOT_S=0.25")
    parser.add_argument("--json", metavar="FILE", help="also write the figures here")
    args = parser.parse_args()
    if min([*args.replicas, args.workers, args.requests, args.burst]) < 1 \
            or args.interval_s < 0:
        parser.error("--replicas, --workers, --requests and --burst must be >= 1, "
                     "--interval-s >= 0")
    # One partition of the assignments topic per worker (the harness's default is 4).
    test_scheduler_service.SLOTS = max(test_scheduler_service.SLOTS, args.workers)
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("LLMQ_"):
            parser.error(f"--set wants LLMQ_NAME=VALUE, got {item!r}")
        ENV[name] = value
    llmq = str(ROOT / ".venv" / "bin" / "llmq")
    started = False
    if not asyncio.run(broker_answers(Settings().bootstrap, 3.0)):
        subprocess.run([llmq, "dev", "kafka", "up"], check=True)
        started = True
    try:
        out = asyncio.run(run(args))
    finally:
        if started:
            subprocess.run([llmq, "dev", "kafka", "down"], check=False)
    for n, figures in out["replicas"].items():
        s, b = figures["steady"], figures["burst"]
        print(f"{n} replica(s): admission to placement p50 {s['p50_ms']:.0f} ms, "
              f"p90 {s['p90_ms']:.0f} ms, p99 {s['p99_ms']:.0f} ms, max {s['max_ms']:.0f} ms "
              f"({s['requests']} high-class requests); burst of {b['requests']}: last placed "
              f"after {b['last_placed_s']:.1f} s, {b['past_usable_kv']} past a worker's KV")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
