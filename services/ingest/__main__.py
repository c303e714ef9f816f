"""``python -m services.ingest``: the admission agents and the HTTP API in one process.

Settings are read here, once: ``LLMQ_*`` (shared), ``LLMQ_INGEST_*`` and
``LLMQ_TENANTS_FILE`` (see :mod:`services.ingest.settings`); flags override them. Tracing
(``LLMQ_OTLP_ENDPOINT``, ``LLMQ_TRACE_SAMPLE_RATIO``) and metrics (``LLMQ_METRICS_PORT``,
127.0.0.1 only) are set up first. Then:
create the catalog topics, the instance's reply topic and the settle topic (Faust creates
only its own changelogs), build the Faust app, register the API on the worker's loop
through Faust's framework-neutral web-server hook (``faust.contrib.asgi.serve_asgi``:
uvicorn starts after table recovery, signals stay with the Faust worker), and run the
worker until SIGINT/SIGTERM. Exit status 2: bad configuration (tenants file, flags).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aiokafka.errors import KafkaError
from faust.contrib.asgi import serve_asgi
from pydantic import ValidationError

from services.common import metrics, tracing
from services.common.faust_app import run_app
from services.common.kafka import ensure_topics, exit_now
from services.common.settings import Settings, warn_unknown_env
from services.ingest.app import IngestRuntime, app_id, build_app
from services.ingest.core import ModelRegistry, TokenCounter, counter_from_tokenizer_json
from services.ingest.http import HttpDeps, create_api
from services.ingest.http.gateway import Gateway
from services.ingest.http.openai import ApiDefaults
from services.ingest.settings import IngestSettings
from services.ingest.tenants import TenantsFileError, load_tenancy
from services.ingest.topics import IngestTopics

_log = logging.getLogger("services.ingest")


def _parse(argv: Sequence[str] | None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m services.ingest",
        description="llmq ingest: OpenAI-compatible API + admission agents (Faust).",
    )
    parser.add_argument("--host", dest="http_host",
                        help="API bind address (LLMQ_INGEST_HTTP_HOST)")
    parser.add_argument("--port", dest="http_port", type=int,
                        help="API port (LLMQ_INGEST_HTTP_PORT)")
    parser.add_argument("--app-name", dest="app_name",
                        help="Faust app name; app id = <prefix>-<name> (LLMQ_INGEST_APP_NAME)")
    parser.add_argument("--instance-id", dest="instance_id",
                        help="reply topic <prefix>.replies.ingest-<id> (LLMQ_INGEST_INSTANCE_ID)")
    parser.add_argument("--tenants-file", dest="tenants_file", type=Path,
                        help="tenants TOML/YAML (LLMQ_TENANTS_FILE)")
    parser.add_argument("--metrics-port", dest="metrics_port", type=int,
                        help="Prometheus port on 127.0.0.1 (LLMQ_METRICS_PORT)")
    parser.add_argument("--loglevel", dest="log_level",
                        choices=("debug", "info", "warning", "error"))
    args = vars(parser.parse_args(argv))
    return {name: value for name, value in args.items() if value is not None}


def _counters(registry: ModelRegistry) -> Mapping[str, TokenCounter]:
    """Exact counters for models whose shape names a tokenizer.json (read once here)."""
    counters: dict[str, TokenCounter] = {}
    for shape in registry:
        if shape.tokenizer is not None:
            text = Path(shape.tokenizer).read_text(encoding="utf-8")
            counters[shape.name] = counter_from_tokenizer_json(text)
    return counters


def main(argv: Sequence[str] | None = None) -> int:
    overrides = _parse(argv)
    warn_unknown_env("ingest", IngestSettings, os.environ)
    try:
        settings = Settings()
        ingest = IngestSettings(**overrides)
        tenancy = load_tenancy(ingest.tenants_file)
        # Read before anything is created on Kafka: a tokenizer that does not load is a
        # configuration error, said in one line.
        counters = _counters(tenancy.config.admission.registry)
    except (ValidationError, TenantsFileError) as exc:
        print(f"ingest: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except (OSError, UnicodeDecodeError) as exc:
        print(f"ingest: invalid configuration: a models.<name>.tokenizer file cannot be "
              f"read: {exc}", file=sys.stderr)
        return 2
    if ingest.metrics_port is not None:
        try:
            metrics.serve(ingest.metrics_port, "ingest")
        except OSError as exc:
            print(f"ingest: cannot serve metrics on 127.0.0.1:{ingest.metrics_port}: {exc}",
                  file=sys.stderr)
            return 2
    tracing.setup("llmq-ingest", settings.otlp_endpoint, settings.trace_sample_ratio)
    instance = ingest.resolved_instance_id()
    topics = IngestTopics.of(
        settings.topic_prefix, app_id(settings, ingest), instance, settings.assignment_partitions
    )
    try:
        asyncio.run(ensure_topics(settings.bootstrap, topics.to_create(),
                                  replication_factor=settings.replication_factor))
    except (KafkaError, OSError, TimeoutError) as exc:
        print(f"ingest: cannot create topics on Kafka at {settings.bootstrap}: {exc!r}",
              file=sys.stderr)
        return 1
    runtime = IngestRuntime(settings, ingest, tenancy, topics, counters)
    built = build_app(runtime)

    api = create_api(HttpDeps(
        gateway=Gateway(settings.bootstrap, topics, instance_id=instance, on_failure=exit_now),
        tenancy=tenancy,
        watcher=built.watcher,
        defaults=ApiDefaults(ingest.completion_default_max_tokens, ingest.chat_default_max_tokens),
        reply_grace_s=ingest.reply_grace_s,
        counters=counters,
    ))
    serve_asgi(built.app, api, host=ingest.http_host, port=ingest.http_port,
               log_config=None, access_log=False)
    print(
        f"ingest: API on http://{ingest.http_host}:{ingest.http_port}/v1 (after table "
        f"recovery), app id {runtime.app_id}, broker {settings.bootstrap}; "
        f"{tenancy.describe()}",
        file=sys.stderr, flush=True,
    )
    run_app(built.app, loglevel=ingest.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
