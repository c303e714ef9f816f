"""Human output of ``llmq status``: rich tables over the status document.

Only formatting here; the document is :func:`services.ops.status.build_status`'s. The KV
bar shows the share of the KV cache *in use* (what fills up as load grows).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from rich.console import Console, JustifyMethod
from rich.table import Table
from rich.text import Text

STATE_STYLES: Final[Mapping[str, str]] = {
    "up": "green", "draining": "yellow", "stale": "red", "gone": "dim",
}


def kv_bar(used_pct: float | None, width: int = 12) -> str:
    """``█████░░░░░░░  42%``; ``n/a`` for a worker without KV."""
    if used_pct is None:
        return "n/a"
    frac = min(max(used_pct / 100.0, 0.0), 1.0)
    full = round(frac * width)
    return f"{'█' * full}{'░' * (width - full)} {used_pct:5.1f}%"


def tokens(n: int) -> str:
    """Compact token counts: 950, 12.3k, 4.5M."""
    if n >= 1_000_000:
        return f"{n / 1_000_000:.1f}M"
    if n >= 10_000:
        return f"{n / 1000:.1f}k"
    return str(n)


def workers_table(status: Mapping[str, Any]) -> Table:
    table = Table(title="workers", title_justify="left")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("slot", "right"), ("worker", "left"), ("model", "left"), ("pool", "left"),
        ("engine", "left"), ("state", "left"), ("KV used", "left"),
        ("KV free/total", "right"), ("running", "right"), ("waiting", "right"),
        ("beat", "right"),
    )
    for col, justify in columns:
        table.add_column(col, justify=justify)
    for w in status["workers"]:
        state = w["state"] + (" (drain requested)" if w.get("drain_requested") and
                              w["state"] == "up" else "")
        table.add_row(
            str(w["slot"]), w["worker_id"], w["model"],
            w["pool"] if w.get("role", "mixed") == "mixed" else f"{w['pool']} ({w['role']})",
            w["engine"],
            Text(state, style=STATE_STYLES.get(w["state"], "")),
            kv_bar(w["kv_used_pct"]),
            f"{tokens(w['kv_free_tokens'])}/{tokens(w['kv_total_tokens'])}",
            str(w["running"]), str(w["waiting"]), f"{w['age_s']:.1f}s ago",
        )
    return table


def topics_table(status: Mapping[str, Any]) -> Table:
    table = Table(title="topics", title_justify="left")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("topic", "left"), ("partitions", "right"), ("depth", "right"), ("lag", "right"),
        ("group", "left"),
    )
    for col, justify in columns:
        table.add_column(col, justify=justify)
    for t in status["topics"]:
        lag = "—" if t["lag"] is None else str(t["lag"])
        group = t["group"] or (f"{len(t['slots'])} slot group(s)" if t["slots"] else "—")
        table.add_row(t["topic"], str(t["partitions"]), str(t["depth"]), lag, group)
    return table


def queues_table(status: Mapping[str, Any]) -> Table:
    table = Table(title="queues (scheduler)", title_justify="left")
    for col in ("model", "scheduler", "pending", "pending tokens", "running tokens",
                "drain tok/s", "live workers", "age"):
        table.add_column(col, justify="left" if col in ("model", "scheduler") else "right")
    for q in status["queues"]:
        age = f"{q['age_s']:.1f}s" + ("" if q["fresh"] else " (stale)")
        table.add_row(q["model"], q["scheduler_id"], str(q["pending_requests"]),
                      tokens(q["pending_tokens"]), tokens(q["running_tokens"]),
                      f"{q['drain_tokens_per_s']:.0f}", str(q["live_workers"]), age)
    return table


def render_status(status: Mapping[str, Any], console: Console) -> None:
    """Print the status document for a person."""
    s = status["summary"]
    console.print(
        f"[bold]llmq[/] on {status['bootstrap']} (prefix {status['topic_prefix']}): "
        f"{s['total']} worker(s) — {s['up']} up, {s['draining']} draining, "
        f"{s['stale']} stale, {s['gone']} gone"
    )
    if status["workers"]:
        console.print(workers_table(status))
    else:
        console.print(f"no workers: no heartbeat on {status['topic_prefix']}.heartbeats")
    if status["queues"]:
        console.print(queues_table(status))
    else:
        console.print(f"no queue status on {status['topic_prefix']}.status "
                      "(no scheduler has published yet)")
    if status["topics"]:
        console.print(topics_table(status))
    if status["missing_topics"]:
        console.print(f"[yellow]missing topics[/]: {', '.join(status['missing_topics'])} "
                      "(`llmq dev topics` creates them)")
    for warning in status.get("warnings", ()):
        console.print(f"[yellow]warning[/]: {warning}")
    urls = status["metrics_urls"]
    if urls:
        console.print("[bold]metrics[/]")
        for name, url in urls.items():
            console.print(f"  {name:<14} {url}")
    else:
        console.print("metrics: no services.json from the stack launcher (llmq up)")
