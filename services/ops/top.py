"""``llmq top``: the cluster live in the terminal (rich ``Live``), refreshed every interval.

Each frame joins two sources:

- **Kafka**, through the same readers as ``llmq status`` (:class:`ClusterReader` keeps a
  :class:`~services.health.fleet.FleetFeed` and a :class:`~services.health.lag.LagInspector`
  open between frames instead of reconnecting every second): workers with their KV bars,
  the scheduler's ``QueueStatus`` per model, lag per topic;
- **the services' /metrics** listed in ``<LLMQ_HOME>/stack/services.json``, scraped once a
  frame: the frame's rates and window latencies are the difference between this scrape
  and the previous one (:mod:`services.ops.top_frame`).

What is missing is said, not hidden: an endpoint that does not answer, a family nobody
exposes, no services.json. Kafka down when ``top`` starts (or on the one read of
``--once``) is an error: one line on stderr, exit 1. Kafka lost later keeps the last good
workers on screen with the error above them, and ``top`` keeps trying.

``--once`` draws one frame (its window is ``--interval``) and exits; with ``--json`` it
prints the frame document instead (:mod:`services.ops.top_frame` docstring).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

import click
import httpx
from aiokafka.errors import KafkaError
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from services.common.kafka import broker_answers
from services.common.settings import Settings
from services.health.core import HealthPolicy
from services.health.fleet import FleetFeed, FleetTracker
from services.health.lag import LagInspector
from services.ops.cli import health_policy
from services.ops.errors import KafkaUnavailable, OpsError
from services.ops.params import FiniteFloatRange
from services.ops.promtext import Scrape, parse_scrape
from services.ops.render import queues_table, topics_table, workers_table
from services.ops.status import build_status, read_metrics_urls, services_file
from services.ops.top_frame import Endpoint, Round, build_frame

#: Per-endpoint scrape timeout: a wedged service must not stall the frame.
SCRAPE_TIMEOUT_S: Final = 2.0
#: Bound on one Kafka read of a frame once connected (the first read gets more).
READ_TIMEOUT_S: Final = 10.0
#: Longest --interval: an hour between frames.
MAX_INTERVAL_S: Final = 3600.0


class ClusterReader:
    """The status document, read repeatedly over connections kept open.

    ``start()`` reads the heartbeats and status topics to their end (as
    :func:`services.ops.status.cluster_status` does); each ``read()`` takes what arrived
    since and asks for fresh offsets. Kafka errors become :class:`KafkaUnavailable`.
    """

    def __init__(self, settings: Settings, group: str | None = None,
                 policy: HealthPolicy | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._settings = settings
        self._group = group
        self._policy = policy or HealthPolicy()
        self._clock = clock
        self._tracker = FleetTracker()
        self._feed = FleetFeed(settings.bootstrap, settings.topic_prefix, self._tracker,
                               read_control=False)
        self._inspector = LagInspector(settings.bootstrap, settings.topic_prefix,
                                       settings.assignment_partitions)

    async def start(self, timeout_s: float = 20.0) -> None:
        bootstrap = self._settings.bootstrap
        if not await broker_answers(bootstrap, 3.0):
            raise KafkaUnavailable(f"no Kafka broker answers at {bootstrap}")
        try:
            async with asyncio.timeout(timeout_s):
                await self._feed.start()
                await self._feed.catch_up(timeout_s)
                await self._inspector.start()
        except (KafkaError, OSError, TimeoutError) as exc:
            await self.stop()
            raise KafkaUnavailable(
                f"could not read the cluster from Kafka at {bootstrap}: {exc!r}") from exc

    async def read(self, timeout_s: float = READ_TIMEOUT_S) -> dict[str, Any]:
        try:
            async with asyncio.timeout(timeout_s):
                # Take what arrived since the last frame; stop at the first empty poll.
                for _ in range(100):
                    if await self._feed.poll(timeout_ms=20) == 0:
                        break
                topics, groups, missing = await self._inspector.figures(self._group)
        except (KafkaError, OSError, TimeoutError) as exc:
            raise KafkaUnavailable(
                f"lost Kafka at {self._settings.bootstrap}: {exc!r}") from exc
        return build_status(
            bootstrap=self._settings.bootstrap,
            prefix=self._settings.topic_prefix,
            records=self._tracker.records().values(),
            queues=self._tracker.queue_statuses(),
            topics=topics,
            groups=groups,
            missing_topics=missing,
            metrics_urls=read_metrics_urls(self._settings.home),
            now=self._clock(),
            policy=self._policy,
        )

    async def stop(self) -> None:
        await self._feed.stop()
        await self._inspector.stop()


async def _scrape_one(client: httpx.AsyncClient, name: str, url: str, at: float
                      ) -> tuple[Scrape | None, Endpoint]:
    try:
        response = await client.get(url)
        response.raise_for_status()
        scrape = parse_scrape(response.text, name, at)
    except httpx.HTTPStatusError as exc:
        return None, Endpoint(name, url, f"HTTP {exc.response.status_code}")
    except httpx.HTTPError as exc:
        return None, Endpoint(name, url, f"unreachable ({type(exc).__name__}: {exc})")
    except httpx.InvalidURL as exc:  # a malformed URL in services.json; not an HTTPError
        return None, Endpoint(name, url, f"bad URL ({exc})")
    except ValueError as exc:
        return None, Endpoint(name, url, f"not Prometheus text ({exc})")
    return scrape, Endpoint(name, url, None, len(scrape.samples))


async def scrape_round(client: httpx.AsyncClient, urls: Mapping[str, str],
                       clock: Callable[[], float] = time.monotonic) -> Round:
    """Scrape every endpoint at once; all scrapes of a round share its start time, so the
    window between two rounds is the same for every endpoint."""
    at = clock()
    results = await asyncio.gather(*(_scrape_one(client, n, u, at) for n, u in urls.items()))
    return Round(at, {s.source: s for s, _ in results if s is not None},
                 tuple(ep for _, ep in results))


async def run_top(settings: Settings, *, group: str | None, interval_s: float, once: bool,
                  emit: Callable[[dict[str, Any]], None],
                  policy: HealthPolicy | None = None,
                  monotonic: Callable[[], float] = time.monotonic) -> None:
    """Emit frames every ``interval_s`` (one with ``once``) until cancelled; workers are
    classified under ``policy`` (default: the default policy).

    Raises :class:`KafkaUnavailable` when the first read of the cluster fails.
    """
    reader = ClusterReader(settings, group, policy)
    await reader.start()
    home = settings.home
    try:
        # trust_env=False: the endpoints are on loopback; an HTTP(S)_PROXY from the
        # environment must not route the scrapes elsewhere.
        async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S, trust_env=False) as client:
            prev = await scrape_round(client, read_metrics_urls(home), monotonic)
            status: dict[str, Any] | None = None
            while True:
                kafka_error: str | None = None
                try:
                    status = await reader.read()
                except KafkaUnavailable as exc:
                    if once or status is None:
                        raise
                    kafka_error = str(exc)
                await asyncio.sleep(max(0.0, prev.at + interval_s - monotonic()))
                cur = await scrape_round(client, read_metrics_urls(home), monotonic)
                emit(build_frame(status=status, bootstrap=settings.bootstrap,
                                 kafka_error=kafka_error, prev=prev, cur=cur,
                                 services_json=services_file(home), now=time.time()))
                if once:
                    return
                prev = cur
    finally:
        await reader.stop()


# -- drawing ---------------------------------------------------------------------------------

def fmt_seconds(value: float | None) -> str:
    """``—``, ``850µs``, ``12.5ms``, ``1.25s``, ``3m05s``."""
    if value is None:
        return "—"
    if value < 1e-3:
        return f"{value * 1e6:.0f}µs"
    if value < 1.0:
        return f"{value * 1e3:.1f}ms"
    if value < 60.0:
        return f"{value:.2f}s"
    minutes, seconds = divmod(round(value), 60)
    return f"{minutes}m{seconds:02d}s"


def fmt_rate(value: float | None) -> str:
    """``—`` for no data; whole numbers from 100 up."""
    if value is None:
        return "—"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _count(value: int | None) -> str:
    return "—" if value is None else str(value)


RATE_COLUMNS: Final = (
    ("requests/s", "requests_per_s"), ("done/s", "done_per_s"),
    ("tokens/s", "tokens_per_s"), ("429/s", "rejected_429_per_s"),
    ("refused/s", "rejected_per_s"), ("placed/s", "placements_per_s"),
    ("admitted tok/s", "admitted_tokens_per_s"),
)
LATENCY_ROWS: Final = (
    ("time to first token", "ttft"), ("request duration", "e2e"),
    ("queue wait", "queue_wait"), ("schedule() decision", "decision"),
)


def rates_table(frame: Mapping[str, Any]) -> Table:
    table = Table(title=f"rates (last {frame['window_s']:.1f}s)", title_justify="left")
    for label, _ in RATE_COLUMNS:
        table.add_column(label, justify="right")
    rates = frame["rates"]
    table.add_row(*(fmt_rate(rates[key]) for _, key in RATE_COLUMNS))
    return table


def classes_table(frame: Mapping[str, Any]) -> Table:
    table = Table(title="queue by class (scheduler)", title_justify="left")
    for col in ("class", "depth", "placed", "mean wait", "p90 wait"):
        table.add_column(col, justify="left" if col == "class" else "right")
    for row in frame["classes"]:
        table.add_row(f"{row['priority']}/{row['lane']}", _count(row["depth"]),
                      _count(row["placed"]), fmt_seconds(row["wait_mean_s"]),
                      fmt_seconds(row["wait_p90_s"]))
    return table


def latency_table(frame: Mapping[str, Any]) -> Table:
    table = Table(title="latency (window | since start)", title_justify="left")
    table.add_column("", justify="left")
    for col in ("n", "p50", "p90", "p99", "n total", "p50 total", "p99 total"):
        table.add_column(col, justify="right")
    for label, key in LATENCY_ROWS:
        w, t = frame["latency"][key]["window"], frame["latency"][key]["total"]
        table.add_row(label, _count(w["count"]), fmt_seconds(w["p50"]),
                      fmt_seconds(w["p90"]), fmt_seconds(w["p99"]), _count(t["count"]),
                      fmt_seconds(t["p50"]), fmt_seconds(t["p99"]))
    return table


def render_frame(frame: Mapping[str, Any]) -> RenderableType:
    """The frame for a person: header, rates, classes, queues, workers, latency, lag."""
    parts: list[RenderableType] = []
    status = frame["status"]
    when = time.strftime("%H:%M:%S", time.localtime(frame["generated_at"]))
    kafka = frame["kafka"]
    head = Text.from_markup(f"[bold]llmq top[/] {when} — Kafka {kafka['bootstrap']}")
    if status is not None:
        s = status["summary"]
        head.append(f" (prefix {status['topic_prefix']}): {s['total']} worker(s) — {s['up']} "
                    f"up, {s['draining']} draining, {s['stale']} stale, {s['gone']} gone")
    parts.append(head)
    if not kafka["ok"]:
        parts.append(Text(f"Kafka: {kafka['error']}", style="bold red"))
    parts.append(rates_table(frame))
    if frame["classes"]:
        parts.append(classes_table(frame))
    if status is not None:
        if status["queues"]:
            parts.append(queues_table(status))
        if status["workers"]:
            parts.append(workers_table(status))
        else:
            parts.append(Text(f"no workers: no heartbeat on {status['topic_prefix']}"
                              ".heartbeats"))
    parts.append(latency_table(frame))
    if status is not None:
        lagging = [t for t in status["topics"] if t["lag"]]
        if lagging:
            parts.append(topics_table({**status, "topics": lagging}))
    for line in frame["missing"]:
        parts.append(Text(f"missing: {line}", style="yellow"))
    return Group(*parts)


# -- the command -----------------------------------------------------------------------------

def _settings(ctx: click.Context) -> Settings:
    obj = ctx.obj
    return obj if isinstance(obj, Settings) else Settings()


@click.command("top")
@click.option("--interval", "interval_s", default=1.0, show_default=True,
              type=FiniteFloatRange(0.1, MAX_INTERVAL_S),
              help="Seconds between frames (with --once: the window rates are measured over).")
@click.option("--once", is_flag=True, help="Print one frame and exit.")
@click.option("--json", "as_json", is_flag=True, help="With --once: print the frame as JSON.")
@click.option("--group", default=None,
              help="The scheduler's consumer group (default: found from committed offsets).")
@click.pass_context
def top(ctx: click.Context, interval_s: float, once: bool, as_json: bool,
        group: str | None) -> None:
    """Live view: queue by class, workers with KV, rates, latency percentiles, lag.

    Reads Kafka (as `llmq status`) and the metrics endpoints of the local stack listed in
    <LLMQ_HOME>/stack/services.json. Exit status 1 when Kafka cannot be read at start,
    2 on a bad option.
    """
    if as_json and not once:
        raise click.UsageError("--json needs --once (one frame as one JSON document)")
    settings = _settings(ctx)
    policy = health_policy()
    console = Console()

    if once:
        frames: list[dict[str, Any]] = []
        try:
            asyncio.run(run_top(settings, group=group, interval_s=interval_s, once=True,
                                emit=frames.append, policy=policy))
        except OpsError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        if as_json:
            click.echo(json.dumps(frames[0], indent=2, sort_keys=True))
        else:
            console.print(render_frame(frames[0]))
        return

    with Live(Text("llmq top: reading the cluster ..."), console=console,
              refresh_per_second=4, screen=False) as live:
        def emit(frame: dict[str, Any]) -> None:
            live.update(render_frame(frame), refresh=True)

        try:
            asyncio.run(run_top(settings, group=group, interval_s=interval_s, once=False,
                                emit=emit, policy=policy))
        except KeyboardInterrupt:
            return
        except OpsError as exc:
            live.stop()
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
