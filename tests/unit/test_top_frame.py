"""One frame of ``llmq top`` from metric text (pure): rates, queue by class, latency
percentiles, what is missing and why, and its rendering. The family names ``top`` reads
must be families of services/common/metrics.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from rich.console import Console

from services.common import metrics
from services.health.core import HealthPolicy, WorkerRecord
from services.ops.promtext import parse_scrape
from services.ops.status import build_status
from services.ops.top import fmt_rate, fmt_seconds, render_frame
from services.ops.top_frame import (
    LATENCIES,
    QUEUE_DEPTH,
    QUEUE_WAIT,
    RATES,
    Endpoint,
    Round,
    build_frame,
)
from tests.fakes.heartbeat_worker import heartbeat
from tests.unit.test_obs_rules import family_series, known_series
from tests.unit.test_top_promtext import counter, histogram

NOW = 1_000_000.0
SERVICES_JSON = Path("/home/stack/services.json")


def test_top_reads_only_families_of_common_metrics() -> None:
    assert {spec.series for spec in RATES} <= known_series()
    assert {family for _, family in LATENCIES} | {QUEUE_WAIT} <= set(family_series())
    assert QUEUE_DEPTH in known_series()


def _wait(p: str, lane: str, b: tuple[float, float, float], total: float
          ) -> tuple[str, list[tuple[str, float]], float]:
    return (f'priority="{p}",lane="{lane}"', [("0.1", b[0]), ("1.0", b[1]), ("+Inf", b[2])],
            total)


def _ttft(b: tuple[float, float, float], total: float) -> str:
    return histogram("llmq_time_to_first_token_seconds", _wait("high", "short", b, total))


def scheduler_text(placed: int, depth_high_short: int, wait: tuple[float, float, float],
                   wait_sum: float) -> str:
    return (
        f'# TYPE llmq_queue_depth gauge\nllmq_queue_depth{{priority="high",lane="short"}} '
        f'{depth_high_short}\nllmq_queue_depth{{priority="low",lane="long"}} 0\n'
        + counter("llmq_placements", ('worker="w1",lane="short"', placed))
        + histogram(QUEUE_WAIT, _wait("high", "short", wait, wait_sum))
        + counter("llmq_requests", ('outcome="queue_timeout"', 1))
    )


def worker_text(done: int, tokens: int, ttft: tuple[float, float, float], ttft_sum: float
                ) -> str:
    return (counter("llmq_requests", ('outcome="done"', done))
            + counter("llmq_generated_tokens", ('worker="w1"', tokens))
            + _ttft(ttft, ttft_sum))


def ingest_text(limited: int) -> str:
    return counter("llmq_rejections", ('code="rate_limited"', limited), ('code="too_large"', 1))


URLS = {"scheduler": "http://127.0.0.1:9400/metrics", "ingest": "http://127.0.0.1:9401/metrics",
        "worker-0": "http://127.0.0.1:9403/metrics"}


def make_round(at: float, texts: dict[str, str], errors: dict[str, str] | None = None) -> Round:
    errors = errors or {}
    scrapes = {name: parse_scrape(text, name, at) for name, text in texts.items()}
    endpoints = tuple(Endpoint(name, URLS[name], errors.get(name),
                               len(scrapes[name].samples) if name in scrapes else 0)
                      for name in sorted(set(texts) | set(errors)))
    return Round(at, scrapes, endpoints)


def status_doc() -> dict[str, Any]:
    beat = heartbeat("w1", ts=NOW, started_at=NOW - 100, interval_s=1.0, kv_total_tokens=1000,
                     kv_free_tokens=250, running=3)
    return build_status(
        bootstrap="127.0.0.1:9092", prefix="llmq", records=[WorkerRecord(beat)], queues=[],
        topics=[], groups={"scheduler": None, "ingest": None}, missing_topics=[],
        metrics_urls=URLS, now=NOW, policy=HealthPolicy())


def frame(prev: Round, cur: Round, **changes: Any) -> dict[str, Any]:
    args: dict[str, Any] = {"status": status_doc(), "bootstrap": "127.0.0.1:9092",
                            "kafka_error": None, "prev": prev, "cur": cur,
                            "services_json": SERVICES_JSON, "now": NOW}
    args.update(changes)
    return build_frame(**args)


PREV = make_round(100.0, {
    "scheduler": scheduler_text(10, 3, (2, 4, 4), 1.0),
    "ingest": ingest_text(100),
    "worker-0": worker_text(50, 5000, (5, 8, 10), 4.0),
})
CUR = make_round(102.0, {
    "scheduler": scheduler_text(16, 7, (2, 10, 10), 4.0),
    "ingest": ingest_text(110),
    "worker-0": worker_text(60, 6000, (5, 18, 20), 7.0),
})


def not_reported(series: str, owner: str) -> str:
    return (f"{series}: no answering endpoint reports it (comes from: {owner}; appears after "
            "the first event)")


def test_rates_over_the_window() -> None:
    f = frame(PREV, CUR)
    assert f["window_s"] == 2.0
    assert f["rates"] == {
        "requests_per_s": pytest.approx((60 - 50) / 2),  # the scheduler's timeout: unchanged
        "done_per_s": pytest.approx(5.0),
        "tokens_per_s": pytest.approx(500.0),
        "rejected_429_per_s": pytest.approx(5.0),
        "rejected_per_s": pytest.approx(5.0),
        "placements_per_s": pytest.approx(3.0),
        "admitted_tokens_per_s": None,  # nobody exposes it here
    }
    assert f["missing"] == [not_reported(series, owner) for series, owner in (
        ("llmq_admitted_tokens_total", "ingest"),
        ("llmq_request_duration_seconds", "worker"),
        ("llmq_schedule_decision_seconds", "scheduler"),
    )]
    assert [ep["name"] for ep in f["endpoints"]] == ["ingest", "scheduler", "worker-0"]
    assert all(ep["ok"] and ep["series"] > 0 for ep in f["endpoints"])


def test_queue_by_class() -> None:
    rows = {(r["priority"], r["lane"]): r for r in frame(PREV, CUR)["classes"]}
    assert len(rows) == 6  # every priority × lane once the scheduler answers
    hs = rows[("high", "short")]
    assert (hs["depth"], hs["placed"]) == (7, 6)
    assert hs["wait_mean_s"] == pytest.approx(3.0 / 6)
    assert hs["wait_p90_s"] == pytest.approx(0.1 + 0.9 * (0.9 * 6) / 6)
    assert rows[("low", "long")] == {"priority": "low", "lane": "long", "depth": 0,
                                     "placed": 0, "wait_mean_s": None, "wait_p90_s": None}
    assert list(rows)[:2] == [("high", "short"), ("high", "long")]


def test_latency_window_and_since_start() -> None:
    ttft = frame(PREV, CUR)["latency"]["ttft"]
    assert ttft["family"] == "llmq_time_to_first_token_seconds"
    assert ttft["window"]["count"] == 10
    assert ttft["window"]["p50"] == pytest.approx(0.1 + 0.9 * 5 / 10)
    assert ttft["window"]["mean"] == pytest.approx(0.3)
    assert ttft["total"]["count"] == 20
    assert ttft["total"]["p50"] == pytest.approx(0.1 + 0.9 * 5 / 13)
    assert ttft["total"]["p99"] == 1.0  # rank in +Inf: the largest finite bound
    e2e = frame(PREV, CUR)["latency"]["e2e"]
    assert e2e["window"] == e2e["total"] == {"count": None, "mean": None, "p50": None,
                                             "p90": None, "p99": None}


def test_an_endpoint_down_is_named_and_its_figures_are_null() -> None:
    cur = make_round(102.0, {"scheduler": scheduler_text(16, 7, (2, 10, 10), 4.0),
                             "worker-0": worker_text(60, 6000, (5, 18, 20), 7.0)},
                     errors={"ingest": "unreachable (ConnectError: refused)"})
    f = frame(PREV, cur)
    assert f["rates"]["rejected_429_per_s"] is None
    assert f["rates"]["tokens_per_s"] == pytest.approx(500.0)
    assert "ingest (http://127.0.0.1:9401/metrics): unreachable (ConnectError: refused)" in (
        f["missing"])
    assert not_reported("llmq_rejections_total", "ingest") in f["missing"]
    assert {ep["name"]: ep["ok"] for ep in f["endpoints"]} == {
        "ingest": False, "scheduler": True, "worker-0": True}


def test_no_services_json_says_so() -> None:
    empty = Round(1.0, {}, ())
    f = frame(empty, Round(2.0, {}, ()))
    assert f["classes"] == [] and set(f["rates"].values()) == {None}
    assert f["missing"] == [f"no metrics endpoints listed in {SERVICES_JSON} (`llmq up` "
                            "writes it): rates, classes and latency need them"]


def test_first_scrape_of_an_endpoint_gives_no_rates_yet() -> None:
    f = frame(Round(100.0, {}, ()), CUR)
    assert set(f["rates"].values()) == {None}
    assert f["missing"] == ["rates need two scrapes of an endpoint; none answered twice yet"]
    hs = next(r for r in f["classes"] if (r["priority"], r["lane"]) == ("high", "short"))
    assert (hs["depth"], hs["placed"]) == (7, None)
    assert f["latency"]["ttft"]["total"]["count"] == 20


def test_kafka_lost_keeps_the_last_status_and_says_so() -> None:
    f = frame(PREV, CUR, kafka_error="lost Kafka at 127.0.0.1:9092: timeout")
    assert f["kafka"] == {"bootstrap": "127.0.0.1:9092", "ok": False,
                          "error": "lost Kafka at 127.0.0.1:9092: timeout"}
    assert f["status"]["workers"][0]["worker_id"] == "w1"
    assert f["missing"][0] == ("Kafka: lost Kafka at 127.0.0.1:9092: timeout (workers and "
                               "queues are from the last good read)")


def test_render_frame_shows_every_part() -> None:
    console = Console(record=True, width=200)
    console.print(render_frame(frame(PREV, CUR, kafka_error="lost Kafka")))
    text = console.export_text()
    for needle in ("llmq top", "1 worker(s) — 1 up", "Kafka: lost Kafka", "429/s", "500",
                   "high/short", "time to first token", "w1", "█████████", "75.0%",
                   "missing: llmq_admitted_tokens_total: no answering endpoint"):
        assert needle in text, needle


def test_render_frame_without_status_or_metrics() -> None:
    console = Console(record=True, width=200)
    empty = Round(1.0, {}, ())
    console.print(render_frame(frame(empty, Round(2.0, {}, ()), status=None)))
    text = console.export_text()
    assert "rates (last 1.0s)" in text and "missing: no metrics endpoints" in text
    assert "queue by class" not in text


@pytest.mark.parametrize(("value", "text"), [
    (None, "—"), (8.5e-4, "850µs"), (0.0125, "12.5ms"), (1.25, "1.25s"), (185.0, "3m05s"),
])
def test_fmt_seconds(value: float | None, text: str) -> None:
    assert fmt_seconds(value) == text


@pytest.mark.parametrize(("value", "text"), [
    (None, "—"), (0.0, "0.0"), (2.345, "2.3"), (1234.5, "1,234"),
])
def test_fmt_rate(value: float | None, text: str) -> None:
    assert fmt_rate(value) == text


@pytest.mark.parametrize("service", sorted(metrics.OWNED))
def test_real_service_endpoints_parse(service: str) -> None:
    """What a real service endpoint serves (its view of the shared registry) parses, and
    its unlabelled families are where top looks for them (labelled ones show no sample
    before their first use)."""
    scrape = parse_scrape(generate_latest(metrics.view(service)).decode(), service, 0.0)
    unlabelled = set().union(*_UNLABELLED.values())
    assert {name for name in unlabelled if scrape.has(name)} == _UNLABELLED[service]


# The samples of every unlabelled family, by the service whose endpoint serves them
# (labelled families are left out: whether they show a sample depends on earlier tests).
_UNLABELLED: dict[str, set[str]] = {
    "ingest": set(),
    "scheduler": {
        "llmq_schedule_decision_seconds_count", "llmq_requeues_total",
        "llmq_worker_losses_total", "llmq_worker_restarts_total",
        "llmq_scheduler_send_failures_total", "llmq_scheduler_outbox_effects",
        "llmq_scheduler_paused_topics",
    },
    "worker": set(),
    "health": {
        "llmq_health_ready", "llmq_health_bad_records", "llmq_health_registry_errors_total",
    },
}
