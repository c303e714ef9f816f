"""Settings of the health service (``LLMQ_HEALTH_*``, plus ``LLMQ_CONSUL_ADDR``,
``LLMQ_CONSUL_TOKEN`` and ``LLMQ_METRICS_PORT``, shared names other services use too).

Read once in ``services.health.__main__`` (flags override the environment) and passed down
frozen, next to the shared :class:`services.common.settings.Settings`; the part that
classifies workers (:class:`HealthPolicySettings`) is read by ``llmq status``, ``drain``
and ``top`` too, at their entry, so that they agree with the service. The HTTP endpoints
always bind 127.0.0.1: nothing llmq serves listens beyond the loopback interface.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.health.core import HealthPolicy

#: Address every endpoint of the service binds.
BIND_HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class ConsulAddress:
    """Where the Consul agent's HTTP API is."""

    host: str
    port: int
    scheme: Literal["http", "https"] = "http"


def parse_consul_addr(addr: str) -> ConsulAddress:
    """``host[:port]`` or ``http(s)://host[:port]``; the port defaults to 8500."""
    parts = urlsplit(addr if "://" in addr else f"http://{addr}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not a Consul address: {addr!r} (want host:port or http://host:port)")
    scheme: Literal["http", "https"] = "https" if parts.scheme == "https" else "http"
    return ConsulAddress(parts.hostname, parts.port or 8500, scheme)


class HealthPolicySettings(BaseSettings):
    """The settings of :class:`~services.health.core.HealthPolicy` (``LLMQ_HEALTH_*``).

    On their own so that ``llmq status``, ``drain`` and ``top`` read the same ones as the
    health service (and classify workers as it does) without needing its other settings.
    """

    model_config = SettingsConfigDict(env_prefix="LLMQ_HEALTH_", frozen=True, extra="ignore")

    staleness: float = Field(
        default=3.0, gt=0, le=100,
        description="A heartbeat is fresh within this many of its own interval_s (DESIGN.md: 3).",
    )
    gone_after_s: float = Field(
        default=60.0, gt=0, le=86_400,
        description="A worker silent this long is deregistered from Consul (state gone); "
        "never sooner than twice its freshness window (services.health.core.gone_after).",
    )
    min_ttl_s: float = Field(
        default=10.0, ge=1, le=3600, description="Smallest TTL of a Consul check."
    )

    def policy(self) -> HealthPolicy:
        return HealthPolicy(self.staleness, self.gone_after_s, self.min_ttl_s)


class HealthSettings(HealthPolicySettings):
    """Each field maps to ``LLMQ_HEALTH_<NAME>`` unless its doc names another variable."""

    model_config = SettingsConfigDict(
        env_prefix="LLMQ_HEALTH_", frozen=True, extra="ignore", populate_by_name=True
    )

    port: int = Field(
        default=8081, ge=1, le=65535,
        description="Port of /healthz, /readyz and /status on 127.0.0.1 (LLMQ_HEALTH_PORT).",
    )
    consul_addr: str | None = Field(
        default=None,
        validation_alias=AliasChoices("LLMQ_CONSUL_ADDR", "LLMQ_HEALTH_CONSUL_ADDR",
                                      "consul_addr"),
        description="Consul agent (host:port or URL); unset: no Consul, Kafka only "
        "(LLMQ_CONSUL_ADDR).",
    )
    consul_token: str | None = Field(
        default=None,
        validation_alias=AliasChoices("LLMQ_CONSUL_TOKEN", "LLMQ_HEALTH_CONSUL_TOKEN",
                                      "consul_token"),
        description="Consul ACL token, if the agent needs one (LLMQ_CONSUL_TOKEN).",
    )
    metrics_port: int | None = Field(
        default=None, ge=1, le=65535,
        validation_alias=AliasChoices("LLMQ_METRICS_PORT", "LLMQ_HEALTH_METRICS_PORT",
                                      "metrics_port"),
        description="Serve Prometheus metrics on 127.0.0.1:<port> when set (LLMQ_METRICS_PORT).",
    )
    instance_id: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="This instance's name (its own Consul service id is llmq-health-<id>); "
        "default <host>-<port>.",
    )
    tick_s: float = Field(
        default=1.0, gt=0, le=60,
        description="How often the registry is reconciled and the gauges refreshed.",
    )
    probe_s: float = Field(
        default=5.0, gt=0, le=600, description="How often /readyz's Kafka probe runs."
    )
    lag_s: float = Field(
        default=5.0, gt=0, le=600,
        description="How often consumer lag is read from the broker for the metrics.",
    )
    status_stale_s: float = Field(
        default=5.0, gt=0, le=3600,
        description="A QueueStatus older than this is shown as not fresh in /status.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="Log level of the service (LLMQ_HEALTH_LOG_LEVEL).")

    @field_validator("consul_addr")
    @classmethod
    def _valid_consul(cls, value: str | None) -> str | None:
        if value is not None:
            parse_consul_addr(value)
        return value

    def consul(self) -> ConsulAddress | None:
        return None if self.consul_addr is None else parse_consul_addr(self.consul_addr)

    def resolved_instance_id(self) -> str:
        """``instance_id``, or ``<host>-<port>`` (stable across restarts)."""
        if self.instance_id is not None:
            return self.instance_id
        host = "".join(c if c.isalnum() or c in "._-" else "-"
                       for c in socket.gethostname().split(".")[0]).strip("-._")
        return f"{host[:40] or 'host'}-{self.port}"
