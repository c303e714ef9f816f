"""Click commands ``status`` and ``drain``; services/cli.py registers them on ``llmq``.

Both read the shared :class:`~services.common.settings.Settings` from the click context
(``llmq`` puts it in ``ctx.obj``), or build one when run on their own. Errors an operator
can act on (Kafka down, unknown worker) print one line on stderr and exit 1.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import click
from rich.console import Console

from services.common.settings import Settings
from services.ops.drain import request_drain
from services.ops.drain_progress import DrainUpdate
from services.ops.errors import OpsError
from services.ops.render import render_status
from services.ops.status import cluster_status


def _settings(ctx: click.Context) -> Settings:
    obj = ctx.obj
    return obj if isinstance(obj, Settings) else Settings()


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the status document as JSON.")
@click.option("--group", default=None,
              help="The scheduler's consumer group (default: found from committed offsets).")
@click.pass_context
def status(ctx: click.Context, as_json: bool, group: str | None) -> None:
    """Workers (state, KV, load), queue depth and lag per topic, metrics URLs."""
    settings = _settings(ctx)
    try:
        doc = asyncio.run(cluster_status(settings, group=group))
    except OpsError as exc:
        _fail(str(exc))
        return
    if as_json:
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
    else:
        render_status(doc, Console())


@click.command("drain")
@click.argument("worker_id")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Follow the worker's heartbeats until it has drained and stopped.")
@click.option("--timeout", "timeout_s", default=300.0, show_default=True, type=float,
              help="Seconds to wait with --wait.")
@click.option("--reason", default="", help="Why, for operators (kept in the command).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_context
def drain(ctx: click.Context, worker_id: str, wait: bool, timeout_s: float, reason: str,
          as_json: bool) -> None:
    """Drain WORKER_ID: it stops taking work, finishes in-flight requests, exits 0.

    Exit status 0 when drained (or, with --no-wait, requested); 1 when the worker is
    unknown, Kafka is down, the wait timed out, or the worker stopped with work in flight.
    """
    settings = _settings(ctx)

    def progress(update: DrainUpdate) -> None:
        if not as_json:
            click.echo(update.describe(), err=True)

    try:
        result = asyncio.run(request_drain(
            settings.bootstrap, settings.topic_prefix, worker_id, reason, wait, timeout_s,
            on_progress=progress,
        ))
    except OpsError as exc:
        _fail(str(exc))
        return
    out: dict[str, Any] = result.as_dict()
    click.echo(json.dumps(out, indent=2, sort_keys=True) if as_json else result.message)
    sys.exit(0 if result.ok else 1)
