"""Click commands ``status`` and ``drain``; services/cli.py registers them on ``llmq``.

Both read the shared :class:`~services.common.settings.Settings` from the click context
(``llmq`` puts it in ``ctx.obj``), or build one when run on their own, and the health
service's staleness settings (:func:`health_policy`), so that they classify workers as it
does. Errors an operator can act on (Kafka down, unknown worker) print one line on stderr
and exit 1; bad options exit 2 before anything is sent.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import click
from pydantic import ValidationError
from rich.console import Console

from schemas.base import MAX_TEXT_CHARS
from services.common.settings import Settings, describe_invalid
from services.health.core import HealthPolicy
from services.health.settings import HealthPolicySettings
from services.ops.drain import request_drain
from services.ops.drain_progress import DrainUpdate
from services.ops.errors import OpsError
from services.ops.params import seconds
from services.ops.render import render_status
from services.ops.status import cluster_status

#: Longest --wait of `llmq drain`, in seconds (a day).
MAX_DRAIN_WAIT_S = 86_400.0


def _settings(ctx: click.Context) -> Settings:
    obj = ctx.obj
    return obj if isinstance(obj, Settings) else Settings()


def health_policy() -> HealthPolicy:
    """The health service's policy from LLMQ_HEALTH_STALENESS, LLMQ_HEALTH_GONE_AFTER_S and
    LLMQ_HEALTH_MIN_TTL_S (read here, at the command's entry), so that ``status``,
    ``drain`` and ``top`` call a worker stale or gone when the health service does."""
    try:
        return HealthPolicySettings().policy()
    except ValidationError as exc:
        raise click.ClickException(
            f"invalid setting: {describe_invalid(exc, 'LLMQ_HEALTH_')}") from exc


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the status document as JSON.")
@click.option("--group", default=None,
              help="The scheduler's consumer group (default: found from committed offsets).")
@click.pass_context
def status(ctx: click.Context, as_json: bool, group: str | None) -> None:
    """Workers (state, KV, load), queue depth and lag per topic, metrics URLs.

    Exit status 1 when Kafka cannot be read.
    """
    settings = _settings(ctx)
    policy = health_policy()
    try:
        doc = asyncio.run(cluster_status(settings, group=group, policy=policy))
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
@click.option("--timeout", "timeout_s", default=300.0, show_default=True,
              type=seconds(MAX_DRAIN_WAIT_S), help="Seconds to wait with --wait.")
@click.option("--reason", default="",
              help=f"Why, for operators (kept in the command; at most {MAX_TEXT_CHARS} "
                   "characters).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_context
def drain(ctx: click.Context, worker_id: str, wait: bool, timeout_s: float, reason: str,
          as_json: bool) -> None:
    """Drain WORKER_ID: it stops taking work, finishes in-flight requests, exits 0.

    \b
    Exit status:
      0  drained (stopped after finishing its work); with --no-wait, the drain was
         requested; or the worker was already gone (nothing is sent)
      1  lost: the worker stopped, or went silent (stale), without a clean drain
         (work in flight, or no draining heartbeat); the wait timed out (the drain
         goes on); the worker is unknown; or Kafka cannot be read
      2  a bad option
    """
    if len(reason) > MAX_TEXT_CHARS:
        raise click.BadParameter(
            f"at most {MAX_TEXT_CHARS} characters (the command's wire limit), got "
            f"{len(reason)}", param_hint="--reason")
    settings = _settings(ctx)
    policy = health_policy()

    def progress(update: DrainUpdate) -> None:
        if not as_json:
            click.echo(update.describe(), err=True)

    try:
        result = asyncio.run(request_drain(
            settings.bootstrap, settings.topic_prefix, worker_id, reason, wait, timeout_s,
            on_progress=progress, policy=policy,
        ))
    except OpsError as exc:
        _fail(str(exc))
        return
    out: dict[str, Any] = result.as_dict()
    click.echo(json.dumps(out, indent=2, sort_keys=True) if as_json else result.message)
    sys.exit(0 if result.ok else 1)
