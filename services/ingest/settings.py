"""Settings of the ingest service (``LLMQ_INGEST_*``, plus ``LLMQ_TENANTS_FILE``,
``LLMQ_HTTP_PORT`` and ``LLMQ_METRICS_PORT``).

Read once in ``services.ingest.__main__`` (command-line flags override the environment)
and passed down frozen, next to the shared :class:`services.common.settings.Settings`.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

_NAME = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,40}$"


class IngestSettings(BaseSettings):
    """Each field maps to ``LLMQ_INGEST_<NAME>``; the tenants file also to
    ``LLMQ_TENANTS_FILE``."""

    model_config = SettingsConfigDict(
        env_prefix="LLMQ_INGEST_", frozen=True, extra="ignore", populate_by_name=True
    )

    http_host: str = Field(
        default="127.0.0.1", description="Address the OpenAI-compatible API binds (loopback)."
    )
    http_port: int = Field(
        default=8080, ge=1, le=65535,
        validation_alias=AliasChoices("LLMQ_INGEST_HTTP_PORT", "LLMQ_HTTP_PORT"),
        description="Port of the API (LLMQ_HTTP_PORT too: the name `llmq up` sets).",
    )
    app_name: str = Field(
        default="ingest",
        pattern=_NAME,
        description="Faust app name; the app id (consumer group) is <topic_prefix>-<name>.",
    )
    instance_id: str | None = Field(
        default=None,
        pattern=_NAME,
        description="This instance's name; its reply topic is <prefix>.replies.ingest-<id>. "
        "Default: <host>-<http_port>, stable across restarts.",
    )
    tenants_file: Path | None = Field(
        default=None,
        validation_alias=AliasChoices("LLMQ_TENANTS_FILE", "LLMQ_INGEST_TENANTS_FILE"),
        description="Tenants file (TOML/YAML, see services/ingest/tenants.py); none: open mode.",
    )
    completion_default_max_tokens: int = Field(
        default=16, ge=1, le=1 << 20, description="max_tokens of /v1/completions when omitted "
        "(OpenAI's default).",
    )
    chat_default_max_tokens: int = Field(
        default=512, ge=1, le=1 << 20, description="max_tokens of /v1/chat/completions when "
        "omitted (OpenAI has no bound; a KV reservation needs one). Lowered to the rest of the "
        "model's context when the prompt leaves less, as vLLM does.",
    )
    reply_grace_s: float = Field(
        default=15.0, gt=0, le=600, description="HTTP waits timeout + this for the terminal "
        "reply before answering 504 and cancelling (longer than a worker sends a terminal "
        "past the deadline: 12 s).",
    )
    heartbeat_staleness: float = Field(
        default=3.0, gt=0, le=100, description="A heartbeat is fresh within this many of its "
        "own interval_s (DESIGN.md: 3).",
    )
    status_stale_s: float = Field(
        default=5.0, gt=0, le=3600, description="A QueueStatus older than this is ignored.",
    )
    reservation_grace_s: float = Field(
        default=30.0, ge=0, le=86_400, description="A reservation whose request's created_at + "
        "timeout_s passed by this much is settled without a terminal event.",
    )
    expiry_scan_s: float = Field(
        default=5.0, gt=0, le=3600, description="How often expired reservations are looked for."
    )
    redelivery_check_s: float = Field(
        default=10.0, gt=0, le=600, description="How long each batch of intake records read "
        "again after a restart or a rebalance is looked for on its reply topics (a request "
        "answered the first time is not decided again); what is not found by then is "
        "decided afresh.",
    )
    cluster_catchup_s: float = Field(
        default=10.0, ge=0, le=600, description="Admission waits up to this long at start for "
        "the heartbeat/status readers to catch up before deciding.",
    )
    metrics_port: int | None = Field(
        default=None, ge=1, le=65535,
        validation_alias=AliasChoices("LLMQ_METRICS_PORT", "LLMQ_INGEST_METRICS_PORT",
                                      "metrics_port"),
        description="Serve Prometheus metrics on 127.0.0.1:<port> when set (LLMQ_METRICS_PORT).",
    )
    log_level: str = Field(default="info", pattern=r"^(debug|info|warning|error)$")

    def resolved_instance_id(self) -> str:
        """``instance_id``, or ``<host>-<http_port>`` made safe for a topic name."""
        if self.instance_id is not None:
            return self.instance_id
        host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0]) or "host"
        return f"{host[:32].strip('-_') or 'host'}-{self.http_port}"
