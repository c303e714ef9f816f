"""Process-wide settings, read once from the environment (``LLMQ_*``) at the edge.

``Settings`` is built in ``main`` (the CLI or a service entry point) and passed down as a
frozen value; nothing below ``main`` reads ``os.environ`` (STYLE.md §8).
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.common import TOPIC_PREFIX_MAX, TOPIC_PREFIX_PATTERN

#: The project checkout this package was installed from (editable install) — the home of
#: the git-ignored ``.llmq/`` folder that holds the broker cache and data by default.
PROJECT_ROOT = Path(__file__).resolve().parents[2]


class Settings(BaseSettings):
    """Settings shared by every llmq process. Each field maps to ``LLMQ_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="LLMQ_", frozen=True, extra="ignore")

    home: Path = Field(
        default=PROJECT_ROOT / ".llmq",
        description="State folder: broker jars cache, broker data, pid and log files.",
    )
    kafka_host: str = Field(
        default="127.0.0.1", description="Address the embedded broker binds and advertises."
    )
    kafka_port: int = Field(default=9092, ge=1, le=65535, description="Broker client port.")
    kafka_controller_port: int = Field(
        default=9093, ge=1, le=65535, description="KRaft controller port (loopback only)."
    )
    kafka_bootstrap: str | None = Field(
        default=None,
        description="Use an external broker instead (host:port,...); overrides host and port.",
    )
    kafka_data_dir: Path | None = Field(
        default=None, description="Broker log dirs; default <home>/kafka."
    )
    kafka_heap_mb: int = Field(default=512, ge=128, le=8192, description="Broker JVM heap.")
    topic_prefix: str = Field(
        default="llmq", pattern=TOPIC_PREFIX_PATTERN, max_length=TOPIC_PREFIX_MAX,
        description="Prefix of every topic: dot-separated words of [A-Za-z0-9_-].",
    )
    replication_factor: int = Field(
        default=1, ge=1, le=16,
        description="Replicas of every topic llmq creates (Faust's changelogs too): 1 on the "
        "single embedded broker; 3 on a production cluster, whose min.insync.replicas then "
        "makes acks=all mean durable on more than one broker.",
    )
    assignment_partitions: int = Field(
        default=16, ge=1, le=1024, description="Partitions of <prefix>.assignments = worker slots."
    )
    otlp_endpoint: str | None = Field(
        default=None,
        description="OTLP/HTTP traces endpoint, e.g. http://127.0.0.1:4318/v1/traces "
        "(`llmq dev jaeger up`); unset: tracing off, nothing is exported.",
    )
    trace_sample_ratio: float = Field(
        default=1.0, ge=0.0, le=1.0,
        description="Share of new traces sampled at their root (ingest); every later hop "
        "follows the root's decision.",
    )

    @field_validator("home", "kafka_data_dir")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        """An absolute path (``~`` expanded): the broker and Jaeger run in their data
        folder, so a relative one (``LLMQ_HOME=state``) named files that were not there
        and the broker failed to start."""
        return None if value is None else value.expanduser().resolve()

    @field_validator("otlp_endpoint")
    @classmethod
    def _traces_url(cls, value: str | None) -> str | None:
        """An http(s) URL; a bare ``scheme://host:port`` gets OTLP's ``/v1/traces`` (as
        OpenTelemetry's OTEL_EXPORTER_OTLP_ENDPOINT does: posted to ``/``, every span was
        dropped)."""
        if value is None or not value.strip():
            return None
        url = urlsplit(value.strip())
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ValueError(f"{value!r} is not an http(s) URL (e.g. "
                             "http://127.0.0.1:4318/v1/traces)")
        if url.path in ("", "/"):
            return f"{url.scheme}://{url.netloc}/v1/traces"
        return value.strip()

    @field_validator("kafka_bootstrap")
    @classmethod
    def _host_ports(cls, value: str | None) -> str | None:
        if value is None:
            return None
        for server in value.split(","):
            host, sep, port = server.strip().rpartition(":")
            if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError(f"{server.strip()!r} is not host:port (e.g. 127.0.0.1:9092; "
                                 "several: comma-separated)")
        return value

    @property
    def bootstrap(self) -> str:
        """The bootstrap servers clients connect to."""
        return self.kafka_bootstrap or f"{self.kafka_host}:{self.kafka_port}"

    @property
    def broker_data_dir(self) -> Path:
        return self.kafka_data_dir or self.home / "kafka"

    @property
    def cache_dir(self) -> Path:
        return self.home / "cache"


def describe_invalid(exc: ValidationError, prefix: str = "LLMQ_") -> str:
    """One line per bad setting, named by its environment variable."""
    lines = []
    for error in exc.errors():
        name = prefix + "_".join(str(p) for p in error["loc"]).upper()
        value = error.get("input")
        lines.append(f"{name}={value!r}: {error['msg']}")
    return "; ".join(lines)


def warn_unknown_env(
    service: str, settings_cls: type[BaseSettings], environ: Mapping[str, str]
) -> None:
    """At a service's start (``main`` passes ``os.environ``): each :func:`unknown_env`
    warning on stderr."""
    for warning in unknown_env(settings_cls, environ):
        print(f"{service}: warning: {warning}", file=sys.stderr, flush=True)


def unknown_env(settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> list[str]:
    """Variables of ``environ`` with ``settings_cls``'s prefix (``LLMQ_WORKER_`` ...) that
    name none of its settings, each as a warning naming the closest one: pydantic-settings
    ignores them in silence, so a misspelt setting would just not apply."""
    prefix = str(settings_cls.model_config.get("env_prefix", "")).upper()
    known = {f"{prefix}{name}".upper() for name in settings_cls.model_fields}
    for field in settings_cls.model_fields.values():
        alias = field.validation_alias
        names = alias.choices if isinstance(alias, AliasChoices) else [alias]
        known.update(n.upper() for n in names if isinstance(n, str))
    warnings = []
    for var in sorted(environ):
        if var.upper().startswith(prefix) and var.upper() not in known:
            close = difflib.get_close_matches(var.upper(), sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            warnings.append(f"{var} is not a setting and is ignored{hint}")
    return warnings
