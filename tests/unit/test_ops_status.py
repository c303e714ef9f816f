"""The status document (pure shaping), the services.json reader and the human rendering."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from schemas.status import QueueStatus
from services.health.core import DrainRequest, HealthPolicy, WorkerRecord
from services.health.lag import SlotLag, TopicFigures
from services.ops.render import kv_bar, render_status, tokens, workers_table
from services.ops.status import build_status, read_metrics_urls, services_file, worker_row
from tests.fakes.heartbeat_worker import heartbeat

NOW = 1_000_000.0
MODEL = heartbeat("w").model


def rec(worker_id: str, age_s: float, **changes: Any) -> WorkerRecord:
    drain = changes.pop("drain", None)
    fields: dict[str, Any] = {"ts": NOW - age_s, "started_at": NOW - 100, "interval_s": 1.0}
    fields.update(changes)
    return WorkerRecord(heartbeat(worker_id, **fields), drain=drain)


def status_doc(records: list[WorkerRecord], **extra: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "bootstrap": "127.0.0.1:9092", "prefix": "llmq", "records": records, "queues": [],
        "topics": [], "groups": {"scheduler": None, "ingest": None}, "missing_topics": [],
        "metrics_urls": {}, "now": NOW, "policy": HealthPolicy(),
    }
    args.update(extra)
    return build_status(**args)


def test_worker_row_kv_and_state() -> None:
    row = worker_row(rec("w1", 0.5, kv_total_tokens=1000, kv_free_tokens=250, partition=2,
                         running=4, waiting=1), NOW, HealthPolicy())
    assert row["state"] == "up"
    assert (row["slot"], row["kv_free_pct"], row["kv_used_pct"]) == (2, 25.0, 75.0)
    assert (row["running"], row["waiting"], row["age_s"]) == (4, 1, 0.5)
    no_kv = worker_row(rec("w2", 0.0, kv_total_tokens=0, kv_free_tokens=0, kv_total_bytes=0,
                           kv_free_bytes=0), NOW, HealthPolicy())
    assert no_kv["kv_free_pct"] is None


def test_worker_row_and_table_show_a_prefill_or_decode_role() -> None:
    row = worker_row(rec("w1", 0.5, role="prefill"), NOW, HealthPolicy())
    assert row["role"] == "prefill"
    assert worker_row(rec("w2", 0.5), NOW, HealthPolicy())["role"] == "mixed"
    table = workers_table({"workers": [row]})
    assert list(table.columns[3].cells) == [f"{row['pool']} (prefill)"]


def test_status_warns_of_prefill_and_decode_workers_no_worker_of_their_engine_pairs(
        ) -> None:
    fleet = [rec("p-sim", 0.5, role="prefill", engine="sim"),
             rec("p-vllm", 0.5, role="prefill", engine="openai", partition=1),
             rec("d-vllm", 0.5, role="decode", engine="openai", partition=2),
             rec("d-old", 0.5, role="decode", engine="vllm", partition=3),
             rec("d-gone", 60.0, role="decode", engine="sim", partition=4),  # stale
             rec("m0", 0.5, engine="sim", partition=5)]
    doc = status_doc(fleet)
    assert doc["warnings"] == [
        f"model {MODEL}: prefill worker(s) p-sim run engine sim, which no decode worker "
        "runs: they stay idle (a prompt's KV passes only between workers of one engine and "
        "model version)",
        f"model {MODEL}: decode worker(s) d-old run engine vllm, which no prefill "
        "worker runs: they only take requests whole"]
    console = Console(record=True, width=400)
    render_status(doc, console)
    assert f"warning: model {MODEL}: prefill worker(s) p-sim" in console.export_text()
    # Paired engines, or one role only (decode workers then take requests whole by
    # design): nothing to say.
    assert status_doc(fleet[1:3])["warnings"] == []
    assert status_doc([fleet[3]])["warnings"] == []


def test_status_warns_of_prefill_and_decode_workers_whose_model_versions_do_not_pair(
        ) -> None:
    # One engine, but the decode workers report no --model-version and the prefill worker
    # does: the scheduler pairs by engine and version, so none of them is paired.
    fleet = [rec("p1", 0.5, role="prefill", engine="vllm", model_version="v2"),
             rec("d1", 0.5, role="decode", engine="vllm", partition=1, model_version=None),
             rec("d2", 0.5, role="decode", engine="vllm", partition=2, model_version=None)]
    assert status_doc(fleet)["warnings"] == [
        f"model {MODEL}: prefill worker(s) p1 run engine vllm at model version v2, which no "
        "decode worker runs: they stay idle (a prompt's KV passes only between workers of "
        "one engine and model version)",
        f"model {MODEL}: decode worker(s) d1, d2 run engine vllm at no model version, which "
        "no prefill worker runs: they only take requests whole"]
    paired = [rec("p1", 0.5, role="prefill", engine="vllm", model_version="v2"),
              rec("d1", 0.5, role="decode", engine="vllm", partition=1, model_version="v2")]
    assert status_doc(paired)["warnings"] == []


def test_drain_requested_only_for_this_incarnation() -> None:
    now_drain = rec("w1", 0.0, drain=DrainRequest("upgrade", NOW - 1))
    old_drain = rec("w2", 0.0, drain=DrainRequest("old", NOW - 1000))
    assert worker_row(now_drain, NOW, HealthPolicy())["drain_requested"] == "upgrade"
    assert worker_row(old_drain, NOW, HealthPolicy())["drain_requested"] is None


@pytest.mark.parametrize(
    ("age_s", "changes", "state"),
    [(0.0, {}, "up"), (0.0, {"draining": True}, "draining"), (10.0, {}, "stale"),
     (100.0, {}, "gone"), (-30.0, {}, "stale")],
)
def test_state_classification(age_s: float, changes: dict[str, Any], state: str) -> None:
    assert worker_row(rec("w", age_s, **changes), NOW, HealthPolicy())["state"] == state


def test_build_status_sorts_and_counts() -> None:
    doc = status_doc([rec("b", 0.0, partition=1), rec("a", 10.0, partition=1),
                      rec("c", 0.0, partition=0, draining=True)])
    assert [w["worker_id"] for w in doc["workers"]] == ["c", "a", "b"]
    assert doc["summary"] == {"up": 1, "draining": 1, "stale": 1, "gone": 0, "total": 3}
    assert set(doc) >= {"workers", "topics", "metrics_urls", "queues", "summary", "schema"}
    json.dumps(doc)  # the document is plain JSON


def test_queue_rows_say_whether_fresh() -> None:
    q = QueueStatus(model="m", scheduler_id="s1", pending_requests=3, pending_tokens=300,
                    running_tokens=50, drain_tokens_per_s=120.0, live_workers=2,
                    max_usable_kv_tokens=1000, ts=NOW - 8)
    doc = status_doc([], queues=[q])
    assert doc["queues"][0]["pending_requests"] == 3
    assert doc["queues"][0]["drain_tokens_per_s"] == 120.0
    assert doc["queues"][0]["fresh"] is False


def test_metrics_urls_file(tmp_path: Path) -> None:
    assert read_metrics_urls(tmp_path) == {}
    path = services_file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({
        "scheduler": {"pid": 10, "metrics_url": "http://127.0.0.1:9400/metrics"},
        "worker-0": {"pid": 11, "metrics_url": "http://127.0.0.1:9403/metrics"},
        "no-metrics": {"pid": 12},
        "junk": 5,
    }))
    assert read_metrics_urls(tmp_path) == {
        "scheduler": "http://127.0.0.1:9400/metrics",
        "worker-0": "http://127.0.0.1:9403/metrics",
    }
    path.write_text("{not json")
    assert read_metrics_urls(tmp_path) == {}


@pytest.mark.parametrize(
    ("pct", "bar"),
    [(None, "n/a"), (0.0, "░" * 12 + "   0.0%"), (50.0, "█" * 6 + "░" * 6 + "  50.0%"),
     (100.0, "█" * 12 + " 100.0%"), (130.0, "█" * 12 + " 130.0%")],
)
def test_kv_bar(pct: float | None, bar: str) -> None:
    assert kv_bar(pct) == bar


@pytest.mark.parametrize(("n", "text"), [(950, "950"), (12_345, "12.3k"), (4_500_000, "4.5M")])
def test_tokens(n: int, text: str) -> None:
    assert tokens(n) == text


def render(doc: dict[str, Any]) -> str:
    console = Console(record=True, width=160, color_system=None)
    render_status(doc, console)
    return console.export_text()


def test_render_without_workers() -> None:
    text = render(status_doc([]))
    assert "no workers" in text
    assert "no services.json" in text


def test_render_full() -> None:
    topics = [
        TopicFigures("llmq.requests.high.short", "requests", 6, 10, 10, "llmq-scheduler", 4),
        TopicFigures("llmq.assignments", "assignments", 4, 3, 3, None, 1,
                     (SlotLag(0, "llmq-worker-slot-0", 2, 3, 1),)),
    ]
    doc = status_doc(
        [rec("w-up", 0.0, kv_total_tokens=1000, kv_free_tokens=500),
         rec("w-stale", 10.0)],
        topics=topics, metrics_urls={"health": "http://127.0.0.1:9402/metrics"},
    )
    text = render(doc)
    for needle in ("w-up", "w-stale", "stale", "50.0%", "llmq.requests.high.short",
                   "llmq-scheduler", "1 slot group(s)", "http://127.0.0.1:9402/metrics",
                   "1 up, 0 draining, 1 stale"):
        assert needle in text, needle


def test_status_warns_of_a_worker_beating_a_slot_the_assignments_topic_lacks() -> None:
    topics = [TopicFigures("llmq.assignments", "assignments", 4, 0, 0, None, None)]
    records = [rec("w-ok", 0.5, partition=3), rec("w-stray", 0.5, partition=4),
               rec("w-gone", 500.0, partition=9)]
    doc = status_doc(records, topics=topics)
    assert len(doc["warnings"]) == 1
    assert doc["warnings"][0].startswith("refused by the schedulers: slot 4 is not a partition")
    assert "w-stray" in doc["warnings"][0]
    # Without the assignments topic's figures nothing is said (not known, not refused).
    assert status_doc(records)["warnings"] == []
