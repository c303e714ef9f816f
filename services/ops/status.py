"""``llmq status``: the whole cluster in one dict (also the health service's ``/status``).

:func:`cluster_status` reads, once: the heartbeats and queue status topics to their end
(newest heartbeat per worker, newest ``QueueStatus`` per model and scheduler), depth and
lag of every catalog topic (:mod:`services.health.lag`), and the metrics URLs of the local
stack. :func:`build_status` turns those into the JSON document; it is pure, so the CLI, the
health service and the tests shape it the same way.

The document (``schema`` 1)::

    {"schema": 1, "generated_at": <unix s>, "bootstrap": "...", "topic_prefix": "llmq",
     "workers": [{"worker_id", "slot", "model", "pool", "role", "engine", "state",
                  "kv_free_tokens", "kv_total_tokens", "kv_free_pct", "kv_used_pct",
                  "running", "waiting", "max_num_seqs", "tokens_per_s", "gpu_util",
                  "draining", "drain_requested", "age_s", "interval_s", ...}, ...],
     "summary": {"up": n, "draining": n, "stale": n, "gone": n, "total": n},
     "queues": [{"model", "scheduler_id", "pending_requests", "pending_tokens",
                 "running_tokens", "drain_tokens_per_s", "live_workers",
                 "max_usable_kv_tokens", "age_s", "fresh"}, ...],
     "topics": [{"topic", "role", "partitions", "depth", "end_offset", "group", "lag",
                 "slots": [{"partition", "group", "committed", "end", "lag"}]}, ...],
     "groups": {"scheduler": <group or null>, "ingest": <group or null>},
     "missing_topics": [...],
     "warnings": ["<one line an operator should act on>", ...],
     "metrics_urls": {"<service instance>": "http://127.0.0.1:PORT/metrics", ...}}

``warnings`` names workers whose heartbeat gives a slot the assignments topic does not
have (:func:`stray_warnings`: the schedulers refuse them, nothing is placed there), then
(:func:`pairing_warnings`) prefill and decode workers of a model whose engine and model
version no worker of the other role shares: the scheduler hands a prompt's KV only between
workers of one engine and one version (a worker that reports no ``--model-version`` pairs
only with others that report none), so those workers sit idle or run requests whole.

Worker states follow :func:`services.health.core.worker_state` (fail closed: a worker we
cannot vouch for is ``stale``, never ``up``), under the policy the caller passes: the CLI
reads the health service's settings for it (:func:`services.ops.cli.health_policy`).
``kv_*_pct`` is null for a worker that reports no KV.

**Metrics URLs** come from ``<LLMQ_HOME>/stack/services.json``, written by the local stack
launcher (``llmq up``, services/stack.py)::

    {"<name>": {"pid": 1234, "metrics_url": "http://127.0.0.1:9400/metrics"}, ...}

Entries without a ``metrics_url`` string are left out; no file (or an unreadable one)
gives an empty map.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from aiokafka.errors import KafkaError

from schemas.status import QueueStatus
from services.common.kafka import broker_answers
from services.common.settings import Settings
from services.health.core import (
    WORKER_STATES,
    HealthPolicy,
    WorkerRecord,
    is_stray,
    stray_note,
    worker_state,
)
from services.health.fleet import FleetFeed, FleetTracker
from services.health.lag import LagInspector, TopicFigures, assignment_slots
from services.ops.errors import KafkaUnavailable

_log = logging.getLogger(__name__)

STATUS_SCHEMA: Final = 1
#: A QueueStatus older than this is shown as not fresh (ingest ignores it too).
STATUS_STALE_S: Final = 5.0


def services_file(home: Path) -> Path:
    """Where the stack launcher lists its services (see the module docstring)."""
    return home / "stack" / "services.json"


def read_metrics_urls(home: Path) -> dict[str, str]:
    """``{service instance: metrics URL}`` from ``services.json``; {} when absent or bad."""
    path = services_file(home)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        _log.warning("ignoring unreadable %s: %s", path, exc)
        return {}
    if not isinstance(data, dict):
        _log.warning("ignoring %s: not a JSON object", path)
        return {}
    return {
        str(name): entry["metrics_url"]
        for name, entry in sorted(data.items())
        if isinstance(entry, dict) and isinstance(entry.get("metrics_url"), str)
    }


def _pct(part: int, total: int) -> float | None:
    return None if total <= 0 else round(100.0 * part / total, 1)


def worker_row(rec: WorkerRecord, now: float, policy: HealthPolicy) -> dict[str, Any]:
    """One worker of the document."""
    hb = rec.heartbeat
    drain = rec.drain if rec.drain is not None and rec.drain.issued_at >= hb.started_at else None
    return {
        "worker_id": hb.worker_id,
        "slot": hb.partition,
        "model": hb.model,
        "model_version": hb.model_version,
        "pool": hb.pool,
        "role": hb.role,
        "engine": hb.engine,
        "state": worker_state(rec, now, policy),
        "kv_free_tokens": hb.kv_free_tokens,
        "kv_total_tokens": hb.kv_total_tokens,
        "kv_free_pct": _pct(hb.kv_free_tokens, hb.kv_total_tokens),
        "kv_used_pct": _pct(hb.kv_total_tokens - hb.kv_free_tokens, hb.kv_total_tokens),
        "running": hb.running,
        "waiting": hb.waiting,
        "max_num_seqs": hb.max_num_seqs,
        "tokens_per_s": hb.tokens_per_s,
        "gpu_util": hb.gpu_util,
        "draining": hb.draining,
        "drain_requested": None if drain is None else (drain.reason or "requested"),
        "tombstoned": rec.tombstoned,
        "age_s": round(now - hb.ts, 3),
        "interval_s": hb.interval_s,
        "started_at": hb.started_at,
        "seq": hb.seq,
    }


def queue_row(qs: QueueStatus, now: float, stale_s: float = STATUS_STALE_S) -> dict[str, Any]:
    """One model's queue status, as the scheduler last published it."""
    return {
        "model": qs.model,
        "scheduler_id": qs.scheduler_id,
        "pending_requests": qs.pending_requests,
        "pending_tokens": qs.pending_tokens,
        "running_tokens": qs.running_tokens,
        "drain_tokens_per_s": qs.drain_tokens_per_s,
        "live_workers": qs.live_workers,
        "max_usable_kv_tokens": qs.max_usable_kv_tokens,
        "age_s": round(now - qs.ts, 3),
        "fresh": abs(now - qs.ts) <= stale_s,  # a clock far ahead is not "fresh" either
    }


def stray_warnings(records: Iterable[WorkerRecord], now: float, policy: HealthPolicy,
                   slots: int | None) -> list[str]:
    """One line per worker not gone whose slot is not a partition of the assignments topic
    (``slots`` partitions; None: the topic was not read, nothing to say)."""
    return [stray_note(r.heartbeat, slots) for r in sorted(records, key=lambda r: r.worker_id)
            if slots is not None and is_stray(r.heartbeat, slots)
            and worker_state(r, now, policy) != "gone"]


def pairing_warnings(workers: Iterable[Mapping[str, Any]]) -> list[str]:
    """For each model, the prefill and decode workers (up, not draining) whose engine and
    model version no worker of the other role shares: their prompts' KV can reach no
    decode worker (the scheduler stages nothing there), or no prompt is handed to them
    (they only run requests whole). Nothing when a model has only one of the two roles."""
    by_model: dict[str, dict[str, dict[tuple[str, str], list[str]]]] = {}
    for w in workers:
        if w["role"] in ("prefill", "decode") and w["state"] == "up" and not w["draining"]:
            roles = by_model.setdefault(w["model"], {"prefill": {}, "decode": {}})
            kind = (w["engine"], w.get("model_version") or "")
            roles[w["role"]].setdefault(kind, []).append(w["worker_id"])
    found = []
    for model, roles in sorted(by_model.items()):
        prefill, decode = roles["prefill"], roles["decode"]
        if not prefill or not decode:
            continue
        for kind in sorted(prefill.keys() - decode.keys()):
            found.append(f"model {model}: prefill worker(s) {', '.join(prefill[kind])} run "
                         f"{_engine_text(kind, decode)}, which no decode worker runs: they "
                         "stay idle (a prompt's KV passes only between workers of one engine "
                         "and model version)")
        for kind in sorted(decode.keys() - prefill.keys()):
            found.append(f"model {model}: decode worker(s) {', '.join(decode[kind])} run "
                         f"{_engine_text(kind, prefill)}, which no prefill worker runs: they "
                         "only take requests whole")
    return found


def _engine_text(kind: tuple[str, str], others: Mapping[tuple[str, str], object]) -> str:
    """"engine E", with the model version when the other role's workers run E too (so the
    version is what keeps them apart; "no model version" for a worker that gives none)."""
    engine, version = kind
    if not any(other == engine for other, _ in others):
        return f"engine {engine}"
    return f"engine {engine} at " + (f"model version {version}" if version
                                     else "no model version")


def build_status(
    *,
    bootstrap: str,
    prefix: str,
    records: Iterable[WorkerRecord],
    queues: Iterable[QueueStatus],
    topics: Sequence[TopicFigures],
    groups: Mapping[str, str | None],
    missing_topics: Sequence[str],
    metrics_urls: Mapping[str, str],
    now: float,
    policy: HealthPolicy,
    status_stale_s: float = STATUS_STALE_S,
) -> dict[str, Any]:
    """The status document of the module docstring (pure)."""
    records = list(records)
    workers = sorted((worker_row(r, now, policy) for r in records),
                     key=lambda w: (w["slot"], w["worker_id"]))
    summary: dict[str, int] = {s: 0 for s in WORKER_STATES}
    for w in workers:
        summary[w["state"]] += 1
    summary["total"] = len(workers)
    return {
        "schema": STATUS_SCHEMA,
        "generated_at": now,
        "bootstrap": bootstrap,
        "topic_prefix": prefix,
        "workers": workers,
        "summary": summary,
        "queues": [queue_row(q, now, status_stale_s) for q in queues],
        "topics": [t.as_dict() for t in topics],
        "groups": dict(groups),
        "missing_topics": list(missing_topics),
        "warnings": (stray_warnings(records, now, policy, assignment_slots(topics))
                     + pairing_warnings(workers)),
        "metrics_urls": dict(metrics_urls),
    }


async def cluster_status(
    settings: Settings,
    *,
    group: str | None = None,
    policy: HealthPolicy | None = None,
    timeout_s: float = 20.0,
    clock: Callable[[], float] = time.time,
) -> dict[str, Any]:
    """Read the cluster once and return the status document.

    ``group`` names the scheduler's consumer group (default: discovered from commits).
    Raises :class:`KafkaUnavailable` when the broker does not answer or the reads do not
    finish within ``timeout_s``.
    """
    if not await broker_answers(settings.bootstrap, 3.0):
        raise KafkaUnavailable(f"no Kafka broker answers at {settings.bootstrap}")
    tracker = FleetTracker()
    feed = FleetFeed(settings.bootstrap, settings.topic_prefix, tracker, read_control=False)
    inspector = LagInspector(
        settings.bootstrap, settings.topic_prefix, settings.assignment_partitions
    )
    try:
        async with asyncio.timeout(timeout_s):
            await feed.start()
            await feed.catch_up(timeout_s)
            await inspector.start()
            topics, groups, missing = await inspector.figures(group)
    except (KafkaError, OSError, TimeoutError) as exc:
        raise KafkaUnavailable(
            f"could not read the cluster from Kafka at {settings.bootstrap}: {exc!r}"
        ) from exc
    finally:
        await feed.stop()
        await inspector.stop()
    return build_status(
        bootstrap=settings.bootstrap,
        prefix=settings.topic_prefix,
        records=tracker.records().values(),
        queues=tracker.queue_statuses(),
        topics=topics,
        groups=groups,
        missing_topics=missing,
        metrics_urls=read_metrics_urls(settings.home),
        now=clock(),
        policy=policy or HealthPolicy(),
    )
