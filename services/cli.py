"""The ``llmq`` command line: dev broker, topics, schema export, benchmarks, the local stack.

Settings are read here, once, and passed down (STYLE.md §8). Heavy imports happen inside
the commands so ``llmq --help`` stays fast.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import click

from services.common.settings import Settings


def _emit(data: dict[str, Any], as_json: bool, text: str) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True) if as_json else text)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.pass_context
def main(ctx: click.Context) -> None:
    """llmq — queue governance for LLM inference fleets, on Kafka.

    Settings come from LLMQ_* environment variables (e.g. LLMQ_KAFKA_PORT=9092,
    LLMQ_TOPIC_PREFIX=llmq, LLMQ_HOME=.llmq).
    """
    ctx.obj = Settings()


# -- dev ---------------------------------------------------------------------------------
@main.group()
def dev() -> None:
    """Developer infrastructure on 127.0.0.1: the embedded Kafka broker and topics."""


@dev.group()
def kafka() -> None:
    """The embedded Apache Kafka broker (KRaft, one node, loopback only)."""


def _broker(settings: Settings) -> Any:
    from services.dev.kafka_broker import BrokerConfig, KafkaBroker

    if settings.kafka_bootstrap:
        raise click.UsageError(
            "LLMQ_KAFKA_BOOTSTRAP points at an external broker; `llmq dev kafka` manages only "
            "the embedded one. Unset it to use the embedded broker."
        )
    return KafkaBroker(BrokerConfig.from_settings(settings))


@kafka.command("up")
@click.option("--timeout", default=90.0, show_default=True, help="Seconds to wait for it.")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.pass_obj
def kafka_up(settings: Settings, timeout: float, as_json: bool) -> None:
    """Fetch (once), format (once) and start the broker in the background; idempotent."""
    from services.dev.kafka_broker import BrokerError

    try:
        status = _broker(settings).up(timeout)
    except BrokerError as exc:
        raise click.ClickException(str(exc)) from exc
    _emit(status.as_dict(), as_json, f"kafka is up on {status.bootstrap} (pid {status.pid}, "
          f"log {status.log_file})")


@kafka.command("down")
@click.pass_obj
def kafka_down(settings: Settings) -> None:
    """Stop the broker started by `up` (by its PID); harmless when none runs."""
    stopped = _broker(settings).down()
    click.echo("kafka stopped" if stopped else "kafka was not running")


@kafka.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No output; exit 0 when it answers, else 1.")
@click.pass_obj
def kafka_status(settings: Settings, as_json: bool, quiet: bool) -> None:
    """Is the broker running and answering? Exit status 0 when it answers."""
    status = _broker(settings).status()
    if not quiet:
        state = "up" if status.answering else ("starting" if status.running else "down")
        _emit(status.as_dict(), as_json, f"kafka is {state} ({status.bootstrap})")
    sys.exit(0 if status.answering else 1)


@dev.command("topics")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_obj
def dev_topics(settings: Settings, as_json: bool) -> None:
    """Create every topic of the catalog that does not exist yet (idempotent)."""
    created = asyncio.run(create_catalog_topics(settings))
    _emit({"created": created, "bootstrap": settings.bootstrap}, as_json,
          f"created {len(created)} topics on {settings.bootstrap}"
          + (": " + ", ".join(created) if created else " (all existed)"))


async def create_catalog_topics(settings: Settings) -> list[str]:
    from schemas.topics import catalog
    from services.common.kafka import TopicRequest, ensure_topics

    specs = catalog(settings.topic_prefix, settings.assignment_partitions)
    wanted = [TopicRequest(s.name, s.partitions, s.config) for s in specs]
    return await ensure_topics(settings.bootstrap, wanted)


# -- schema ------------------------------------------------------------------------------
@main.group()
def schema() -> None:
    """Wire schemas: JSON Schema per message and an AsyncAPI 3.0 document."""


@schema.command("export")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              required=True, help="Folder to write into (created if missing).")
def schema_export(out_dir: Path) -> None:
    """Write <kind>.schema.json for every message and asyncapi.yaml."""
    from schemas.export import export

    paths = export(out_dir)
    click.echo(f"wrote {len(paths)} files to {out_dir}")


# -- up ----------------------------------------------------------------------------------
@main.command("up")
@click.pass_context
def up(ctx: click.Context) -> None:
    """Run the local stack on embedded defaults (Kafka on 127.0.0.1, topics)."""
    settings: Settings = ctx.obj
    ctx.invoke(kafka_up, timeout=90.0, as_json=False)
    created = asyncio.run(create_catalog_topics(settings))
    click.echo(f"topics ready ({len(created)} created) with prefix '{settings.topic_prefix}'")
    click.echo(f"Kafka bootstrap: {settings.bootstrap}   stop with: llmq dev kafka down")


if __name__ == "__main__":
    main()
