"""Figures of one simulated run, computed from the job records alone.

Per request (times in seconds from its arrival):

* ``e2e``  = finish − arrival;  ``ttft`` = first token − arrival;
* ``wait`` = max(0, ttft − ttft alone): everything the request waited before its first
  token beyond its own prefill — in a central queue, in the engine's queue, and behind
  other sequences' steps. It is comparable across policies whether they queue centrally
  (fifo-rr, llmq) or inside the engines (least-requests, vllm-random);
* ``queue`` = dispatch − arrival, plus, for a request run in two stages, hand-off →
  decode dispatch: the time spent in the policy's own queue (0 for policies that route
  on arrival);
* ``slowdown`` = e2e ÷ e2e alone (``latency_alone`` on an idle engine, ≥ 1);
* ``service`` = finish − dispatch.

``e2e_alone_p99_s`` is the P99 of the lane's requests' latency alone, over every request
that arrived (but those no engine could ever hold): the floor under any policy's
``e2e_p99_with_rejections_s``. On this cost model no request finishes faster than alone (a
batch only adds to each step, and a prefill/decode hand-off adds a transfer and a step),
and a rejection counts at least as long as every rejected request's time alone (below), so
the k-th fastest latency is at least the k-th fastest latency alone. (The plain
``e2e_p99_s`` has no such floor: shedding the slowest requests lowers it.)

Per lane and per priority class: P50, P90 and P99 of ``wait``, ``queue``, ``ttft`` and
``e2e`` (keys ``{name}_p{50,90,99}_s``); per class also the maximum ``wait`` and
``queue``, per lane the slowdowns and throughput below.

Percentiles interpolate linearly between closest ranks (numpy's default method) over
completed requests (a class's ``wait`` and ``queue`` count its rejected requests too, see
:func:`class_summary`). The
``*_with_rejections`` variants count every rejected request as if it had taken the whole
request timeout (``timeout_s``) — the latency of a client that gives up — or as long as
the slowest completed request, or the longest time alone of a rejected request, if that is
longer (a failure never counts as faster than a success, nor than it could have been
served). ``rejection_rate`` is shown beside them.

Throughput: ``completed_tokens_per_s`` = Σ (prompt + output) tokens of the requests of a
lane completed by the last arrival ÷ (last arrival − first arrival) — sustained throughput
while the load is offered; work still queued when arrivals stop does not count, so a
policy that lets a lane fall behind shows it here.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from schemas.common import LANES, PRIORITIES
from services.sim.fleet import COMPLETED, REJECTED, Job

Summary = dict[str, Any]

_QUANTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's
    default): rank ``(n − 1) · q / 100`` of the sorted values."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _pct(values: Sequence[float], q: float) -> float | None:
    return _round(percentile(values, q)) if values else None


def _round(x: float) -> float:
    return round(x, 6)


def _max(values: Iterable[float]) -> float | None:
    found = max(values, default=None)
    return None if found is None else _round(found)


def _latencies(jobs: Sequence[Job]) -> dict[str, list[float]]:
    done = [j for j in jobs if j.state == COMPLETED]
    out: dict[str, list[float]] = {"e2e": [], "ttft": [], "wait": [], "queue": [], "slow": []}
    for j in done:
        assert j.finished_s is not None and j.first_token_s is not None
        assert j.dispatched_s is not None
        e2e = j.finished_s - j.arrival_s
        ttft = j.first_token_s - j.arrival_s
        out["e2e"].append(e2e)
        out["ttft"].append(ttft)
        out["wait"].append(max(0.0, ttft - j.ttft_alone_s))
        out["queue"].append(j.dispatched_s - j.arrival_s + j.handoff_queue_s)
        out["slow"].append(e2e / j.e2e_alone_s)
    return out


def _with_rejections(
    values: list[float], rejected: Sequence[Job], timeout_s: float, q: float
) -> float | None:
    # A rejection is a failure: never faster than any success (a timeout shorter than the
    # slowest completion must not make shedding look good), nor than the request alone.
    alone = (j.e2e_alone_s for j in rejected if math.isfinite(j.e2e_alone_s))
    failed = max(timeout_s, max(values, default=0.0), max(alone, default=0.0))
    return _pct(values + [failed] * len(rejected), q)


def lane_summary(jobs: Sequence[Job], timeout_s: float, window: tuple[float, float]) -> Summary:
    """Figures of one lane's jobs (see the module docstring)."""
    lat = _latencies(jobs)
    shed = [j for j in jobs if j.state == REJECTED]
    rejected = len(shed)
    out: Summary = {
        "arrived": len(jobs),
        "completed": len(lat["e2e"]),
        "rejected": rejected,
        "rejection_rate": _round(rejected / len(jobs)) if jobs else 0.0,
    }
    for name in ("e2e", "ttft", "wait"):
        for q in _QUANTILES:
            out[f"{name}_p{q}_s"] = _pct(lat[name], q)
    for q in _QUANTILES:
        out[f"queue_p{q}_s"] = _pct(lat["queue"], q)
    alone = [j.e2e_alone_s for j in jobs if math.isfinite(j.e2e_alone_s)]
    out["e2e_alone_p99_s"] = _pct(alone, 99)
    out["slowdown_p50"] = _pct(lat["slow"], 50)
    out["slowdown_p99"] = _pct(lat["slow"], 99)
    for name in ("e2e", "ttft"):
        out[f"{name}_p99_with_rejections_s"] = _with_rejections(lat[name], shed, timeout_s, 99)
    start, end = window
    tokens = sum(
        j.prompt + j.output
        for j in jobs
        if j.state == COMPLETED and j.finished_s is not None and j.finished_s <= end
    )
    out["completed_tokens_per_s"] = _round(tokens / (end - start)) if end > start else None
    return out


def class_summary(jobs: Sequence[Job], timeout_s: float) -> Summary:
    """Figures of one priority class's jobs. A rejected request counts as waiting, and
    queued, for the whole timeout (or until its rejection, if later), as in the
    ``*_with_rejections`` figures: a class cannot look served sooner by having its
    longest waits shed, nor by refusals on arrival (counted as 0 s they lowered it)."""
    lat = _latencies(jobs)
    shed = [j for j in jobs if j.state == REJECTED]
    until_shed = [max(timeout_s, j.finished_s - j.arrival_s)
                  for j in shed if j.finished_s is not None]
    wait, queue = lat["wait"] + until_shed, lat["queue"] + until_shed
    out: Summary = {
        "arrived": len(jobs),
        "completed": len(lat["e2e"]),
        "rejected": len(shed),
    }
    for name, values in (("wait", wait), ("queue", queue)):
        for q in _QUANTILES:
            out[f"{name}_p{q}_s"] = _pct(values, q)
        out[f"{name}_max_s"] = _max(values)
    for name in ("ttft", "e2e"):  # of completed requests, as per lane
        for q in _QUANTILES:
            out[f"{name}_p{q}_s"] = _pct(lat[name], q)
    out["e2e_p99_with_rejections_s"] = _with_rejections(lat["e2e"], shed, timeout_s, 99)
    return out


def summarize(jobs: Sequence[Job], timeout_s: float) -> Summary:
    """Per-lane, per-class and fleet-wide figures of one run."""
    window = (jobs[0].arrival_s, jobs[-1].arrival_s) if jobs else (0.0, 0.0)
    lanes = {lane: lane_summary([j for j in jobs if j.lane == lane], timeout_s, window)
             for lane in LANES}
    classes = {p: class_summary([j for j in jobs if j.priority == p], timeout_s)
               for p in PRIORITIES}
    codes = Counter(j.reject_code for j in jobs if j.state == REJECTED and j.reject_code)
    service = (
        j.finished_s - j.dispatched_s
        for j in jobs
        if j.state == COMPLETED and j.finished_s is not None and j.dispatched_s is not None
    )
    return {
        "lanes": lanes,
        "classes": classes,
        "rejections": dict(sorted(codes.items())),
        "completed": sum(1 for j in jobs if j.state == COMPLETED),
        "rejected": sum(codes.values()),
        "max_service_s": _max(service),
        "jobs_preempted": sum(1 for j in jobs if j.preemptions),
    }


def cdf_points(
    jobs: Sequence[Job], lane: str, points: int = 200
) -> tuple[list[float], list[float]]:
    """(latency, fraction) pairs of the e2e CDF of a lane's completed jobs, for plots."""
    values = sorted(
        j.finished_s - j.arrival_s
        for j in jobs
        if j.lane == lane and j.state == COMPLETED and j.finished_s is not None
    )
    n = len(values)
    if n == 0:
        return [], []
    k = min(points, n)
    idx = sorted({round(i * (n - 1) / (k - 1)) for i in range(k)}) if k > 1 else [n - 1]
    return [values[i] for i in idx], [(i + 1) / n for i in idx]
