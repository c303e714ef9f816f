"""``python -m services.scheduler``: the scheduler service (one Faust worker process).

Settings are read here, once: ``LLMQ_*`` (shared) and ``LLMQ_SCHEDULER_*`` (see
:mod:`services.scheduler.settings`), ``LLMQ_METRICS_PORT``; flags override them. Then:
validate the placement profile, create the catalog topics (Faust creates none of them),
build the app, serve metrics if asked (127.0.0.1 only), set up tracing
(``LLMQ_OTLP_ENDPOINT``, ``LLMQ_TRACE_SAMPLE_RATIO``) and run the worker until SIGINT/SIGTERM.
Exit status 2: bad configuration; 1: Kafka unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from typing import Any

from aiokafka.errors import KafkaError
from pydantic import ValidationError

from services.common import tracing
from services.common.faust_app import leader_topic, run_app
from services.common.kafka import ensure_topics
from services.common.settings import Settings, warn_unknown_env
from services.scheduler import ConfigError, build_pipeline
from services.scheduler.app import SchedulerRuntime, app_id, build_app
from services.scheduler.runtime.topics import SchedulerTopics
from services.scheduler.settings import SchedulerSettings


def _parse(argv: Sequence[str] | None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m services.scheduler",
        description="llmq scheduler: pending queue, placement, KV reservations (Faust).",
    )
    parser.add_argument("--scheduler-id", dest="scheduler_id",
                        help="id in events and QueueStatus (LLMQ_SCHEDULER_SCHEDULER_ID)")
    parser.add_argument("--app-name", dest="app_name",
                        help="Faust app name; app id = <prefix>-<name> (LLMQ_SCHEDULER_APP_NAME)")
    parser.add_argument("--profile-file", dest="profile_file",
                        help="placement profile TOML (LLMQ_SCHEDULER_PROFILE_FILE)")
    parser.add_argument("--max-pending", dest="max_pending", type=int,
                        help="bound of the pending queue (LLMQ_SCHEDULER_MAX_PENDING)")
    parser.add_argument("--loglevel", dest="log_level",
                        choices=("debug", "info", "warning", "error"))
    args = vars(parser.parse_args(argv))
    return {name: value for name, value in args.items() if value is not None}


def main(argv: Sequence[str] | None = None) -> int:
    overrides = _parse(argv)
    warn_unknown_env("scheduler", SchedulerSettings, os.environ)
    try:
        settings = Settings()
        scheduler = SchedulerSettings(**overrides)
        build_pipeline(scheduler.profile())  # fail here, not inside the running app
        scheduler.queue_config()
    except (ValidationError, ConfigError, OSError, ValueError) as exc:
        print(f"scheduler: invalid configuration: {exc}", file=sys.stderr)
        return 2
    topics = SchedulerTopics.of(settings.topic_prefix, settings.assignment_partitions)
    try:
        faust_topics = [leader_topic(app_id(settings, scheduler))]
        asyncio.run(ensure_topics(settings.bootstrap, [*topics.to_create(), *faust_topics],
                                  replication_factor=settings.replication_factor))
    except (KafkaError, OSError, TimeoutError) as exc:
        print(f"scheduler: cannot create topics on Kafka at {settings.bootstrap}: {exc!r}",
              file=sys.stderr)
        return 1
    runtime = SchedulerRuntime(settings, scheduler, topics)
    built = build_app(runtime)
    if scheduler.metrics_port is not None:
        try:
            built.scheduler.metrics.serve(scheduler.metrics_port)
        except OSError as exc:
            print(f"scheduler: cannot serve metrics on 127.0.0.1:{scheduler.metrics_port}: "
                  f"{exc}", file=sys.stderr)
            return 2
    tracing.setup("llmq-scheduler", settings.otlp_endpoint, settings.trace_sample_ratio)
    print(
        f"scheduler: id {scheduler.resolved_scheduler_id()}, app id {runtime.app_id}, "
        f"broker {settings.bootstrap}, prefix {settings.topic_prefix}, "
        f"{settings.assignment_partitions} worker slots",
        file=sys.stderr, flush=True,
    )
    run_app(built.app, loglevel=scheduler.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
