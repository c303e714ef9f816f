"""The ``llmq`` command line: dev broker, topics, schema export, benchmarks, the local stack.

Settings are read here, once, and passed down (STYLE.md §8). Heavy imports happen inside
the commands so ``llmq --help`` stays fast.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from services.common.settings import Settings
from services.ops.params import PORT, FiniteFloatRange, seconds

if TYPE_CHECKING:
    from services.stack import StackConfig


#: How long a detached `llmq up` watches its children before reporting them started.
_DETACH_SETTLE_S = 3.0
#: Longest wait any command takes a timeout for: a day.
_MAX_WAIT_S = 86_400.0


def _emit(data: dict[str, Any], as_json: bool, text: str) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True) if as_json else text)


def operator_error(exc: BaseException, settings: Settings | None) -> str | None:
    """What to tell an operator about an error they can fix (None: a bug, keep the
    traceback): Kafka not answering, an unreachable HTTP service, a bad setting or input."""
    from aiokafka.errors import KafkaError, UnknownTopicOrPartitionError
    from httpx import TransportError
    from pydantic import ValidationError

    from llmq.client import TopicMissing
    from services.common.settings import describe_invalid

    if isinstance(exc, TopicMissing):
        return str(exc)
    if isinstance(exc, UnknownTopicOrPartitionError):
        where = settings.bootstrap if settings is not None else "the configured bootstrap"
        return (f"Kafka at {where} lacks a topic llmq uses ({exc}): start llmq there "
                "(`llmq up`), or check LLMQ_TOPIC_PREFIX.")
    if isinstance(exc, KafkaError):
        where = settings.bootstrap if settings is not None else "the configured bootstrap"
        return (f"Kafka at {where} did not answer ({exc or type(exc).__name__}). Start the "
                "local broker with `llmq dev kafka up` (or `make up`), or point "
                "LLMQ_KAFKA_BOOTSTRAP at yours.")
    if isinstance(exc, TransportError):
        try:
            url = str(exc.request.url)
        except RuntimeError:  # raised before a request was made
            url = "the service"
        return f"could not reach {url} ({type(exc).__name__}: {exc}); is `llmq up` running?"
    if isinstance(exc, ValidationError):
        if exc.title == Settings.__name__:
            return f"invalid setting: {describe_invalid(exc)}"
        return "invalid input: " + "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or exc.title}: {e['msg']}"
            for e in exc.errors())
    if isinstance(exc, ValueError | OverflowError):  # an input number past what floats hold
        return f"invalid input: {exc}"
    if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError
                  | NotADirectoryError):
        return f"{exc.strerror}: {exc.filename}"
    return None


class _Cli(click.Group):
    """The root group: errors an operator can fix end in one line and exit 1, not a
    traceback (LLMQ_DEBUG=1 keeps the traceback)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:
            message = operator_error(exc, ctx.obj if isinstance(ctx.obj, Settings) else None)
            if message is None or os.environ.get("LLMQ_DEBUG"):
                raise
            raise click.ClickException(message) from exc


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.pass_context
def main(ctx: click.Context) -> None:
    """llmq — queue governance for LLM inference fleets, on Kafka.

    Settings come from LLMQ_* environment variables (e.g. LLMQ_KAFKA_PORT=9092,
    LLMQ_TOPIC_PREFIX=llmq, LLMQ_HOME=.llmq). LLMQ_DEBUG=1 shows tracebacks.
    """
    if not os.environ.get("LLMQ_DEBUG"):
        # The commands say in one line when Kafka does not answer; aiokafka's own log of
        # each failed connection would come first, on stderr with no handler set.
        import logging

        logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    ctx.obj = Settings()


# -- dev ---------------------------------------------------------------------------------
@main.group()
def dev() -> None:
    """Developer infrastructure on 127.0.0.1: the embedded Kafka broker, the topics
    (on LLMQ_KAFKA_BOOTSTRAP's broker when set) and Jaeger."""


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
@click.option("--timeout", default=90.0, show_default=True, type=seconds(3600),
              help="Seconds to wait for it to answer.")
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


@kafka.command("ping")
@click.option("--timeout", default=3.0, show_default=True, type=seconds(600),
              help="Seconds to wait for an answer.")
@click.pass_obj
def kafka_ping(settings: Settings, timeout: float) -> None:
    """Exit 0 when any broker answers on the configured bootstrap (ours or not), else 1
    (2 on a bad option)."""
    from services.common.kafka import broker_answers

    sys.exit(0 if asyncio.run(broker_answers(settings.bootstrap, timeout)) else 1)


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
    return await ensure_topics(settings.bootstrap, wanted,
                               replication_factor=settings.replication_factor)


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


# -- bench -------------------------------------------------------------------------------
@main.group()
def bench() -> None:
    """Benchmarks: one scheduling decision, and policies compared on real traces."""


@bench.command("decide")
@click.option("--workers", default=1000, show_default=True, type=click.IntRange(1),
              help="Fleet size.")
@click.option("--pending", default=10000, show_default=True, type=click.IntRange(1),
              help="Queued requests.")
@click.option("--repeats", default=2000, show_default=True, type=click.IntRange(1),
              help="Placements measured.")
@click.option("--seed", default=1, show_default=True,
              help="Seed of the fleet and queue drawn (the same seed, the same decisions).")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def bench_decide(workers: int, pending: int, repeats: int, seed: int, as_json: bool) -> None:
    """Time one placement decision of the scheduling core (µs, p50/p99)."""
    from services.scheduler.bench import bench_decide as run

    figures = run(workers=workers, pending=pending, seed=seed, repeats=repeats)
    text = (f"one placement with {workers} workers and {pending} pending: "
            f"p50 {figures['placement_p50_us']:.1f} µs, p99 {figures['placement_p99_us']:.1f} µs")
    _emit(figures, as_json, text)


def _register_commands() -> None:
    """Commands that live beside the code they drive."""
    from services.dev.jaeger import jaeger
    from services.ops.cli import drain, status
    from services.ops.top import top
    from services.sim.cli import policies

    bench.add_command(policies)
    main.add_command(status)
    main.add_command(drain)
    main.add_command(top)
    dev.add_command(jaeger)


_register_commands()


# -- submit ------------------------------------------------------------------------------
@main.command("submit")
@click.argument("prompt")
@click.option("--max-tokens", default=128, show_default=True,
              type=click.IntRange(1, 1 << 20), help="Most tokens to generate.")
@click.option("--priority", type=click.Choice(["high", "normal", "low"]), default="normal",
              show_default=True,
              help="Requested class; admission lowers it to the tenant's max priority.")
@click.option("--lane", type=click.Choice(["short", "long"]), default=None,
              help="Lane hint (honoured only if the tenant may set it).")
@click.option("--tenant", default="default", show_default=True,
              help="Tenant the request is accounted to (replies come on its reply topic).")
@click.option("--model", default="llama-3.1-8b", show_default=True,
              help="Model as the fleet names it.")
@click.option("--chat", is_flag=True, help="Send PROMPT as one user chat message.")
@click.option("--timeout", "timeout_s", default=120.0, show_default=True,
              type=seconds(_MAX_WAIT_S),
              help="The request's timeout in seconds: llmq ends it (queue_timeout, or timeout "
                   "once running) past this; the command waits 15 s more for that answer "
                   "(llmq.client's DEFAULT_REPLY_GRACE_S).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object at the end.")
@click.pass_obj
def submit(settings: Settings, prompt: str, max_tokens: int, priority: str, lane: str | None,
           tenant: str, model: str, chat: bool, timeout_s: float, as_json: bool) -> None:
    """Submit PROMPT over Kafka and stream the generated tokens to the terminal.

    Exit status 0 when the request finished, 1 on an error reply (the error is printed).
    """
    result = asyncio.run(_submit(settings, prompt, max_tokens, priority, lane, tenant, model,
                                 chat, timeout_s, stream_out=not as_json))
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True))
    sys.exit(0 if result["outcome"] == "done" else 1)


async def _submit(settings: Settings, prompt: str, max_tokens: int, priority: str,
                  lane: str | None, tenant: str, model: str, chat: bool, timeout_s: float,
                  *, stream_out: bool) -> dict[str, Any]:
    from llmq.client import LlmqClient
    from schemas.replies import Done
    from services.common.replies import AttemptText

    client = LlmqClient(settings.bootstrap, tenant=tenant, prefix=settings.topic_prefix,
                        default_model=model, replication_factor=settings.replication_factor)
    ask: dict[str, Any] = {
        "prompt": None if chat else prompt, "messages": [("user", prompt)] if chat else None,
        "max_tokens": max_tokens, "priority": priority, "lane": lane, "timeout_s": timeout_s,
    }
    client.new_request(**ask)  # a bad input is one line now, before Kafka is reached
    async with client:
        started = time.time()
        handle = await client.submit(**ask)
        text = AttemptText()
        try:
            async for chunk in handle:
                if stream_out and text.attempt is not None and chunk.attempt > text.attempt:
                    # Printed text cannot be taken back: say that it is void.
                    click.echo(f"\n[llmq restarted the request (attempt {chunk.attempt}): "
                               "the text above is void]", err=True)
                text.add(chunk)
                if stream_out:
                    click.echo(chunk.text, nl=False)
        except TimeoutError as exc:
            if stream_out:
                raise click.ClickException(str(exc)) from exc
            return {"request_id": handle.request_id, "text": text.text,
                    "e2e_s": round(time.time() - started, 4), "outcome": "error",
                    "code": "client_timeout", "message": str(exc), "retry_after_s": None}
        end = handle.result
        assert end is not None
        text.add(end)  # a newer attempt that sent no chunk voids the older text
        out: dict[str, Any] = {"request_id": handle.request_id, "text": text.text,
                               "e2e_s": round(time.time() - started, 4)}
        if isinstance(end, Done):
            out |= {"outcome": "done", "usage": end.usage.model_dump(),
                    "timings": end.timings.model_dump(), "finish_reason": end.finish_reason}
            if stream_out:
                click.echo(f"\n[done: {end.usage.completion_tokens} tokens, ttft "
                           f"{end.timings.ttft_s or 0:.3f} s, e2e {end.timings.e2e_s:.3f} s]",
                           err=True)
        else:
            out |= {"outcome": "error", "code": end.code, "message": end.message,
                    "retry_after_s": end.retry_after_s}
            if stream_out:
                click.echo(f"\n[error {end.code}: {end.message}]", err=True)
        return out


# -- demo ----------------------------------------------------------------------------------
@main.command("demo")
@click.option("--requests", "n", default=200, show_default=True, type=click.IntRange(2),
              help="Requests to replay (the first N of the trace).")
@click.option("--rate", default=10.0, show_default=True, help="Arrivals per second.",
              type=FiniteFloatRange(0, 10_000, min_open=True))
@click.option("--trace", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="Trace file (default: the Azure conversation trace).")
@click.option("--url", default="http://127.0.0.1:8080", show_default=True,
              help="Base URL of the ingest HTTP API.")
@click.option("--model", default="llama-3.1-8b", show_default=True,
              help="Model to ask for.")
@click.option("--max-prompt", default=4000, show_default=True, type=click.IntRange(1),
              help="Clip prompt tokens to at most this many.")
@click.option("--max-output", default=400, show_default=True, type=click.IntRange(1),
              help="Clip output tokens to at most this many.")
@click.option("--timeout", "timeout_s", default=120.0, show_default=True,
              type=seconds(_MAX_WAIT_S), help="Per-request timeout (s).")
@click.option("--seed", default=1, show_default=True,
              help="Seed of the tenants, priority classes and filler prompt text drawn.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.pass_obj
def demo(settings: Settings, n: int, rate: float, trace: Path | None, url: str, model: str,
         max_prompt: int, max_output: int, timeout_s: float, seed: int, as_json: bool) -> None:
    """Replay a slice of the Azure trace through the running stack (HTTP and Kafka).

    Needs `llmq up` running (one started here moments ago is waited for, up to 60 s).
    Prints latency by lane and priority, rejections and tokens/s.
    Trace: Azure LLM inference trace 2023, CC-BY 4.0 (Patel et al., Splitwise, ISCA 2024).
    """
    from rich.console import Console
    from rich.progress import Progress

    from services.common.settings import PROJECT_ROOT
    from services.demo import plan, run_demo
    from services.stack import ServicesFileError, running_services

    path = trace or PROJECT_ROOT.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
    if not path.exists():
        raise click.ClickException(f"trace not found: {path} (pass --trace)")
    requests = plan(path, n, rate, seed, max_prompt, max_output)
    err = Console(stderr=True)
    # A stack recorded here may still be starting (`llmq up --detach` returns before ingest
    # listens): its API is waited for a while; with none, nothing is (a clear error at once).
    try:
        wait_s = 60.0 if running_services(settings) else 0.0
    except ServicesFileError:
        wait_s = 0.0
    with Progress(console=err, disable=as_json or not err.is_terminal) as bar:
        task = bar.add_task("demo", total=len(requests))
        summary = asyncio.run(run_demo(
            settings.bootstrap, settings.topic_prefix, url, requests, model, seed, timeout_s,
            progress=lambda done, _total: bar.update(task, completed=done),
            replication_factor=settings.replication_factor, wait_s=wait_s))
    _print_demo(summary, as_json)
    if not summary["completed"]:
        click.echo(f"no request completed ({summary['rejections'] or 'no answers'}): see "
                   "`llmq status` and the services' logs", err=True)
        sys.exit(1)


def _print_demo(summary: dict[str, Any], as_json: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    if as_json:
        click.echo(json.dumps(summary, indent=2, sort_keys=True))
        return
    table = Table(title=f"llmq demo: {summary['requests']} requests in "
                        f"{summary['elapsed_s']:.1f} s, {summary['tokens_per_s']} tokens/s")
    for col in ("group", "requests", "completed", "ttft p50", "ttft p99", "e2e p50", "e2e p99"):
        table.add_column(col)
    for name, row in summary["groups"].items():
        cells = [row[k] for k in ("ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s")]
        table.add_row(name, str(row["requests"]), str(row["completed"]),
                      *("-" if v is None else f"{v:.3f} s" for v in cells))
    Console().print(table)
    click.echo(f"rejections: {summary['rejections'] or 'none'}")


# -- up / down ---------------------------------------------------------------------------
def lane_workers(prefill_workers: int, short_workers: int, long_workers: int,
                 given: set[str]) -> tuple[int, int]:
    """(short, long) workers of `llmq up`: with prefill workers, a split fleet, none beside
    it unless asked for on the command line (``given``: the options that were)."""
    if not prefill_workers:
        return short_workers, long_workers
    return (short_workers if "short_workers" in given else 0,
            long_workers if "long_workers" in given else 0)


@main.command("up")
@click.option("--detach", is_flag=True, help="Start in the background; stop with `llmq down`.")
@click.option("--short-workers", default=2, show_default=True, type=click.IntRange(0),
              help="Sim workers of the short-lane pool.")
@click.option("--long-workers", default=1, show_default=True, type=click.IntRange(0),
              help="Sim workers of the long-lane pool.")
@click.option("--any-workers", default=0, show_default=True, type=click.IntRange(0),
              help="Sim workers taking both lanes (interleaved 3 short : 1 long).")
@click.option("--prefill-workers", default=0, show_default=True, type=click.IntRange(0),
              help="Workers that compute prompts and hand their KV cache on (prefill and "
                   "decode apart; give --decode-workers too; the short and long workers "
                   "then default to 0).")
@click.option("--decode-workers", default=0, show_default=True, type=click.IntRange(0),
              help="Workers that take the prefill workers' hand-offs.")
@click.option("--schedulers", default=1, show_default=True, type=click.IntRange(1, 16),
              help="Scheduler replicas: one consumer group that splits the request "
                   "partitions; they place on each worker in turns (docs/live-system.md, "
                   "\"Several scheduler replicas\"). Metrics ports of replicas 2.. come "
                   "after the workers'.")
@click.option("--http-port", default=8080, show_default=True, type=PORT,
              help="Ingest HTTP port.")
@click.option("--health-port", default=8081, show_default=True, type=PORT,
              help="Health service port.")
@click.option("--metrics-base-port", default=9400, show_default=True, type=PORT,
              help="First of the services' Prometheus ports (one per service, upwards: "
                   "3 plus one per worker and one per scheduler replica past the first).")
@click.option("--profile", default="llama3-8b-h100", show_default=True,
              help="Engine profile of the sim workers.")
@click.option("--model", default="llama-3.1-8b", show_default=True,
              help="Model the sim workers serve.")
@click.option("--kafka-only", is_flag=True,
              help="Start only Kafka and the topics, then return (the broker runs on; "
                   "`llmq down` stops it).")
@click.option("--jaeger", "with_jaeger", is_flag=True,
              help="Also run Jaeger on 127.0.0.1:16686 (built with Go on first use) and send "
                   "traces to it; tracing stays off when it cannot start.")
@click.option("--keep-kafka", is_flag=True,
              help="Leave the embedded broker running when the foreground stack stops.")
@click.pass_context
def up(ctx: click.Context, detach: bool, short_workers: int, long_workers: int,
       any_workers: int, prefill_workers: int, decode_workers: int, schedulers: int,
       http_port: int,
       health_port: int, metrics_base_port: int, profile: str, model: str, kafka_only: bool,
       with_jaeger: bool, keep_kafka: bool,
       ) -> None:
    """Run the whole local stack on embedded defaults, in the foreground (Ctrl-C stops it).

    Kafka (embedded, 127.0.0.1), ingest with the OpenAI-compatible API on
    127.0.0.1:8080, the scheduler, health, and sim workers (by default 2 short-pool + 1
    long-pool; the options below change ports and workers).
    In the foreground, Ctrl-C also stops the broker and Jaeger if this command started
    them (`--keep-kafka` leaves the broker); `--detach` leaves all to `llmq down`.
    At most LLMQ_ASSIGNMENT_PARTITIONS workers (one slot each); the ports must not overlap.
    Exit status 2 on a bad option, before anything starts. One `llmq up` at a time per
    LLMQ_HOME: a second is refused (exit 1) while one starts or runs.
    """
    from services.stack import (
        ServicesFileError,
        StackBusy,
        StackConfig,
        config_problem,
        running_services,
        start_lock,
    )

    if (prefill_workers == 0) != (decode_workers == 0):
        raise click.BadParameter(
            "prefill workers hand their requests to decode workers: give both "
            "--prefill-workers and --decode-workers, or neither", param_hint="--decode-workers")
    given = {name for name in ("short_workers", "long_workers")
             if ctx.get_parameter_source(name) != click.core.ParameterSource.DEFAULT}
    short_workers, long_workers = lane_workers(prefill_workers, short_workers, long_workers,
                                               given)
    settings: Settings = ctx.obj
    cfg = StackConfig(
        short_workers=short_workers, long_workers=long_workers, any_workers=any_workers,
        prefill_workers=prefill_workers, decode_workers=decode_workers,
        schedulers=schedulers, http_port=http_port,
        health_port=health_port, metrics_base_port=metrics_base_port,
        profile=profile, model=model)
    taken: dict[int, str] = {}
    if not settings.kafka_bootstrap:  # the embedded broker this command may start
        taken[settings.kafka_port] = "Kafka's port (LLMQ_KAFKA_PORT)"
        taken[settings.kafka_controller_port] = ("Kafka's controller port "
                                                 "(LLMQ_KAFKA_CONTROLLER_PORT)")
    if with_jaeger:
        from services.dev.jaeger import PORTS as JAEGER_PORTS

        taken.update({port: f"Jaeger's {name} port" for name, port in JAEGER_PORTS.items()})
    problem = None if kafka_only else config_problem(cfg, settings.assignment_partitions,
                                                     taken)
    if problem is not None:
        option, message = problem
        raise click.BadParameter(message, param_hint=option)
    try:
        if not kafka_only:  # the broker alone is started once (its own pid file)
            # Held until this command returns; taken before the check below, so that a
            # detached start finishing in between is seen.
            ctx.with_resource(start_lock(settings))
        running = running_services(settings)
    except (StackBusy, ServicesFileError) as exc:
        raise click.ClickException(str(exc)) from exc
    if running and not kafka_only:
        raise click.ClickException(
            f"a stack is already running here ({', '.join(running)}); stop it with "
            "`llmq down` first")
    started_kafka = not settings.kafka_bootstrap and not _broker(settings).status().running
    started_jaeger = False
    # Until the stack's own handlers take over, SIGTERM, SIGHUP and SIGQUIT end this command
    # through the `finally` below (and the broker's and Jaeger's own failure handling), so
    # nothing this run started is left behind: their default action would kill it outright.
    previous = {sig: signal.signal(sig, _exit_on_signal) for sig in _STOP_SIGNALS}
    started = False  # detached and started: the broker and Jaeger stay for `llmq down`
    try:
        if not settings.kafka_bootstrap:
            ctx.invoke(kafka_up, timeout=90.0, as_json=False)
        started_jaeger = with_jaeger and _start_jaeger(settings)
        _up(ctx, settings, detach, cfg, kafka_only)
        started = True
    finally:
        for sig in _STOP_SIGNALS:  # the clean-up below is bounded: let it finish
            signal.signal(sig, signal.SIG_IGN)
        # A detached start that failed stopped its children; what this run started before
        # them goes too, as the error says ("everything started was stopped").
        _stop_what_up_started(ctx, settings, detach and started, kafka_only and started,
                              started_kafka, started_jaeger, keep_kafka)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _stop_what_up_started(ctx: click.Context, settings: Settings, detach: bool,
                          kafka_only: bool, started_kafka: bool, started_jaeger: bool,
                          keep_kafka: bool) -> None:
    if not detach and not kafka_only:
        if started_jaeger:
            _jaeger_of(settings).down()
            click.echo("jaeger stopped")
        if started_kafka and not keep_kafka:
            ctx.invoke(kafka_down)
    elif started_jaeger:  # detached: `llmq down` stops the Jaeger this command started
        _jaeger_marker(settings).parent.mkdir(parents=True, exist_ok=True)
        _jaeger_marker(settings).touch()


def _jaeger_marker(settings: Settings) -> Path:
    from services.stack import stack_dir

    return stack_dir(settings) / "jaeger.started"


def _start_jaeger(settings: Settings) -> bool:
    """Start Jaeger unless it runs and point the children's traces at it; True if started
    here. Failing to start only leaves tracing off."""
    from services.dev.jaeger import OTLP_HTTP_TRACES, JaegerError

    jaeger = _jaeger_of(settings)
    running = jaeger.status().running
    try:
        jaeger.up(echo=click.echo)
    except (JaegerError, OSError) as exc:
        click.echo(f"llmq: Jaeger unavailable ({exc}); tracing off", err=True)
        return False
    os.environ["LLMQ_OTLP_ENDPOINT"] = OTLP_HTTP_TRACES
    click.echo("llmq: traces go to Jaeger, query API and UI on http://127.0.0.1:16686")
    return not running


def _jaeger_of(settings: Settings) -> Any:
    from services.dev.jaeger import Jaeger

    return Jaeger.from_settings(settings)


def _up(ctx: click.Context, settings: Settings, detach: bool, cfg: StackConfig,
        kafka_only: bool) -> None:
    from services.stack import (
        Stack,
        run_foreground,
        settings_env,
        stack_dir,
        stack_services,
        write_services_file,
    )

    created = asyncio.run(create_catalog_topics(settings))
    click.echo(f"topics ready ({len(created)} created) with prefix '{settings.topic_prefix}'")
    if kafka_only:
        click.echo(f"Kafka bootstrap: {settings.bootstrap}   stop with: llmq down")
        return
    stack = Stack(stack_services(cfg), settings_env(settings))
    click.echo(f"llmq: OpenAI-compatible API on http://127.0.0.1:{cfg.http_port}/v1 ; "
               f"Kafka on {settings.bootstrap} ; workers: {cfg.short_workers} short, "
               f"{cfg.long_workers} long, {cfg.any_workers} any, {cfg.prefill_workers} "
               f"prefill, {cfg.decode_workers} decode (sim engine, "
               f"profile {cfg.profile})"
               + (f" ; {cfg.schedulers} scheduler replicas" if cfg.schedulers > 1 else ""))
    if detach:
        stack.start(log_dir=stack_dir(settings))
        path = stack_dir(settings) / "services.json"
        try:
            path = write_services_file(settings, stack)
            time.sleep(_DETACH_SETTLE_S)  # a child that fails at once (a port taken, ...)
            dead = stack.failed()
            if dead:
                name, code = dead[0]
                raise click.ClickException(
                    f"{name} exited with status {code} right after start; see "
                    f"{path.parent / (name + '.log')} (everything started was stopped)")
            click.echo(f"started in the background; logs and pids in {path.parent}; "
                       "stop with: llmq down")
        except BaseException:
            # A child that died, a stop signal, or services.json not written, before the
            # stack is handed to `llmq down`: its children go, as the broker and Jaeger
            # will (the caller).
            for sig in _STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)  # the caller puts them back
            stack.stop(grace_s=10.0)
            path.unlink(missing_ok=True)
            raise
        return
    click.echo("Ctrl-C stops everything.")
    status = run_foreground(stack, on_started=lambda: write_services_file(settings, stack))
    (stack_dir(settings) / "services.json").unlink(missing_ok=True)
    if status:
        ctx.exit(status)


@main.command("down")
@click.option("--keep-kafka", is_flag=True, help="Leave the embedded broker running.")
@click.pass_context
def down(ctx: click.Context, keep_kafka: bool) -> None:
    """Stop what `llmq up --detach` started: its services, its Jaeger, then the embedded
    Kafka broker, whoever started it (`llmq dev kafka up` too; `--keep-kafka` leaves it).

    A malformed entry of <LLMQ_HOME>/stack/services.json is skipped with a warning; a file
    that is not a JSON object stops nothing and exits 1.
    """
    from services.stack import ServicesFileError, stop_detached

    settings: Settings = ctx.obj
    try:
        stopped = stop_detached(settings)
    except ServicesFileError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"stopped {len(stopped)} services" + (": " + ", ".join(stopped) if stopped else ""))
    marker = _jaeger_marker(settings)
    if marker.exists():  # started by a detached `llmq up --jaeger`
        _jaeger_of(settings).down()
        marker.unlink(missing_ok=True)
        click.echo("jaeger stopped")
    if not keep_kafka and not settings.kafka_bootstrap:
        ctx.invoke(kafka_down)


if __name__ == "__main__":
    main()
