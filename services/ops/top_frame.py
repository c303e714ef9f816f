"""One frame of ``llmq top`` as data: :func:`build_frame` (pure; :mod:`services.ops.top`
gathers the inputs and draws it).

Inputs: the cluster status document (:func:`services.ops.status.build_status`, or None
when Kafka could not be read this time) and two rounds of scrapes of the services' metrics
endpoints, ``window_s`` apart. Rates and "window" latencies come from the difference of
the two rounds; "total" latencies from the newer round alone (since each process started).

The frame (``schema`` 1)::

    {"schema": 1, "generated_at": <unix s>, "window_s": <s between the two rounds>,
     "kafka": {"bootstrap", "ok", "error"},
     "status": <the status document, or null>,
     "endpoints": [{"name", "url", "ok", "error", "series"}, ...],
     "rates": {"requests_per_s", "done_per_s", "tokens_per_s", "rejected_429_per_s",
               "rejected_per_s", "placements_per_s", "admitted_tokens_per_s"},
     "classes": [{"priority", "lane", "depth", "placed", "wait_mean_s", "wait_p90_s"}, ...],
     "latency": {"ttft" | "e2e" | "queue_wait" | "decision":
                 {"family", "window": {"count", "mean", "p50", "p90", "p99"},
                  "total": {...same}}},
     "missing": ["what could not be shown, and why", ...]}

A figure nobody exposes is null, never 0: 0 means "measured, nothing happened".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from schemas.common import LANES, PRIORITIES
from services.common import metrics
from services.ops.promtext import Histogram, Scrape, gauge_by, histograms, rate, window_histograms

FRAME_SCHEMA: Final = 1
QUANTILES: Final = (0.5, 0.9, 0.99)


@dataclass(frozen=True, slots=True)
class RateSpec:
    """``key``: the per-second rate of counter series ``series`` (labels ``where``)."""

    key: str
    series: str
    where: Mapping[str, str] = field(default_factory=dict)


#: Family names: services/common/metrics.py (tests/unit/test_top_frame.py checks them).
QUEUE_DEPTH: Final = "llmq_queue_depth"
QUEUE_WAIT: Final = "llmq_queue_wait_seconds"
#: llmq_requests_total is counted once per request, where its terminal reply is sent
#: (ingest, scheduler or worker), so summing it over every endpoint is right.
RATES: Final[tuple[RateSpec, ...]] = (
    RateSpec("requests_per_s", "llmq_requests_total"),
    RateSpec("done_per_s", "llmq_requests_total", {"outcome": "done"}),
    RateSpec("tokens_per_s", "llmq_generated_tokens_total"),
    RateSpec("rejected_429_per_s", "llmq_rejections_total", {"code": "rate_limited"}),
    RateSpec("rejected_per_s", "llmq_rejections_total"),
    RateSpec("placements_per_s", "llmq_placements_total"),
    RateSpec("admitted_tokens_per_s", "llmq_admitted_tokens_total"),
)
#: (frame key, histogram family).
LATENCIES: Final[tuple[tuple[str, str], ...]] = (
    ("ttft", "llmq_time_to_first_token_seconds"),
    ("e2e", "llmq_request_duration_seconds"),
    ("queue_wait", QUEUE_WAIT),
    ("decision", "llmq_schedule_decision_seconds"),
)


def exposed_by(series: str) -> str:
    """Which services' endpoints show ``series`` (:data:`services.common.metrics.OWNED`),
    so "missing" can say whose endpoint to look at."""
    family = series.removesuffix("_total")
    owners = [service for service in metrics.OWNED if family in metrics.family_names(service)]
    return ", ".join(owners) or "no service"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """How one metrics endpoint answered in the newer round."""

    name: str
    url: str
    error: str | None = None
    series: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "ok": self.error is None,
                "error": self.error, "series": self.series}


@dataclass(frozen=True, slots=True)
class Round:
    """One scrape of every endpoint listed in services.json, taken at ``at`` (monotonic)."""

    at: float
    scrapes: Mapping[str, Scrape]
    endpoints: tuple[Endpoint, ...]


def summarize(h: Histogram | None) -> dict[str, Any]:
    """Count, mean and :data:`QUANTILES` of one histogram (nulls without observations)."""
    if h is None or h.count <= 0:
        return {"count": 0 if h is not None else None, "mean": None,
                **{f"p{round(q * 100)}": None for q in QUANTILES}}
    return {"count": round(h.count), "mean": h.mean,
            **{f"p{round(q * 100)}": h.quantile(q) for q in QUANTILES}}


_PRIORITY_RANK: Final[dict[str, int]] = {p: i for i, p in enumerate(PRIORITIES)}
_LANE_RANK: Final[dict[str, int]] = {lane: i for i, lane in enumerate(LANES)}


def _class_order(key: tuple[str, ...]) -> tuple[int, int, tuple[str, ...]]:
    priority, lane = key
    return (_PRIORITY_RANK.get(priority, len(PRIORITIES)), _LANE_RANK.get(lane, len(LANES)),
            key)


def _paired(prev: Round, cur: Round) -> bool:
    """Some endpoint answered in both rounds (so there is a window to measure)."""
    return any(source in prev.scrapes for source in cur.scrapes)


def classes(prev: Round, cur: Round) -> list[dict[str, Any]]:
    """Queue per (priority, lane): depth now, placements and wait over the window.

    Empty when no scraped endpoint exposes the scheduler's queue families; every class of
    PRIORITIES × LANES is listed once the scheduler answers, plus any other it reports.
    """
    scrapes = list(cur.scrapes.values())
    has_depth = any(s.has(QUEUE_DEPTH) for s in scrapes)
    queue_sources = [src for src, s in cur.scrapes.items()
                     if s.has(QUEUE_DEPTH) or s.has(QUEUE_WAIT + "_count")]
    if not queue_sources:
        return []
    by = ("priority", "lane")
    depth = gauge_by(scrapes, QUEUE_DEPTH, by)
    waits = window_histograms(prev.scrapes, cur.scrapes, QUEUE_WAIT, by)
    keys = set(depth) | set(waits) | {(p, ln) for p in PRIORITIES for ln in LANES}
    # A scheduler scraped in both rounds that shows no wait observation placed nothing.
    paired = any(src in prev.scrapes for src in queue_sources)
    rows = []
    for key in sorted(keys, key=_class_order):
        wait = waits.get(key)
        rows.append({
            "priority": key[0], "lane": key[1],
            "depth": round(depth.get(key, 0.0)) if has_depth else None,
            # No window observation of a class while the scheduler answers: nothing placed.
            "placed": round(wait.count) if wait is not None else (0 if paired else None),
            "wait_mean_s": None if wait is None else wait.mean,
            "wait_p90_s": None if wait is None else wait.quantile(0.9),
        })
    return rows


def latency(prev: Round, cur: Round) -> dict[str, dict[str, Any]]:
    """Window and since-start summaries of each :data:`LATENCIES` histogram, all classes."""
    out: dict[str, dict[str, Any]] = {}
    for key, family in LATENCIES:
        total = histograms(cur.scrapes.values(), family).get(())
        window = window_histograms(prev.scrapes, cur.scrapes, family).get(())
        out[key] = {"family": family, "window": summarize(window), "total": summarize(total)}
    return out


def missing_lines(status: Mapping[str, Any] | None, kafka_error: str | None, prev: Round,
                  cur: Round, rates: Mapping[str, float | None],
                  lat: Mapping[str, Mapping[str, Any]], services_json: Path) -> list[str]:
    """What the frame cannot show, each with the reason, for an operator."""
    out: list[str] = []
    if kafka_error is not None:
        out.append(f"Kafka: {kafka_error}"
                   + (" (workers and queues are from the last good read)" if status else ""))
    if status is not None and status["missing_topics"]:
        out.append(f"topics missing: {', '.join(status['missing_topics'])} "
                   "(`llmq dev topics` creates them)")
    if not cur.endpoints:
        out.append(f"no metrics endpoints listed in {services_json} (`llmq up` writes it): "
                   "rates, classes and latency need them")
        return out
    for ep in cur.endpoints:
        if ep.error is not None:
            out.append(f"{ep.name} ({ep.url}): {ep.error}")
    if not _paired(prev, cur):
        out.append("rates need two scrapes of an endpoint; none answered twice yet")
        return out
    absent = [spec.series for spec in RATES if rates[spec.key] is None]
    absent += [family for key, family in LATENCIES if lat[key]["total"]["count"] is None]
    if not any(s.has(QUEUE_DEPTH) for s in cur.scrapes.values()):
        absent.append(QUEUE_DEPTH)
    for series in dict.fromkeys(absent):  # once each, in order
        # Labelled families show no sample before their first event, so "not reported"
        # is often "nothing happened yet" rather than a missing service.
        out.append(f"{series}: no answering endpoint reports it (comes from: "
                   f"{exposed_by(series)}; appears after the first event)")
    return out


def build_frame(*, status: Mapping[str, Any] | None, bootstrap: str, kafka_error: str | None,
                prev: Round, cur: Round, services_json: Path, now: float) -> dict[str, Any]:
    """The frame of the module docstring (pure)."""
    rates = {spec.key: rate(prev.scrapes, cur.scrapes, spec.series, spec.where)
             for spec in RATES}
    lat = latency(prev, cur)
    return {
        "schema": FRAME_SCHEMA,
        "generated_at": now,
        "window_s": round(cur.at - prev.at, 3),
        "kafka": {"bootstrap": bootstrap, "ok": kafka_error is None, "error": kafka_error},
        "status": None if status is None else dict(status),
        "endpoints": [ep.as_dict() for ep in cur.endpoints],
        "rates": rates,
        "classes": classes(prev, cur),
        "latency": lat,
        "missing": missing_lines(status, kafka_error, prev, cur, rates, lat, services_json),
    }
