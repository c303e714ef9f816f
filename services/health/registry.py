"""The one extension point of the health service: where worker registrations go.

:class:`Registry` is what the reconcile plan of :mod:`services.health.core` is applied to.
The production adapter is :class:`services.health.consul_registry.ConsulRegistry`; tests use
the in-memory fake in ``tests/fakes/health_registry.py``. Every method may block (an HTTP call
to a Consul agent): the service calls them from a worker thread, never on the event loop.

Implementations raise :class:`RegistryError` for anything that went wrong; the service then
forgets what it believed was applied for that service id and re-registers it on the next
tick, so a restarted Consul agent is repopulated without special cases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

#: States of a TTL check we set. ``warning`` exists in Consul but llmq never sets it.
CheckStatus = Literal["passing", "critical"]


class RegistryError(Exception):
    """The registry refused or could not be reached."""


@dataclass(frozen=True, slots=True)
class ServiceRegistration:
    """One service instance with one TTL check (check id ``service:<service_id>``)."""

    name: str
    service_id: str
    tags: tuple[str, ...] = ()
    meta: tuple[tuple[str, str], ...] = ()
    #: The check turns critical if not passed within this many seconds.
    ttl_s: float = 10.0
    address: str | None = None
    port: int | None = None


class Registry(Protocol):
    """Service registrations with TTL checks and maintenance mode (Consul's agent API)."""

    def service_ids(self, name: str) -> set[str]:
        """Ids of the registered instances of service ``name``."""
        ...

    def register(self, reg: ServiceRegistration) -> None:
        """Create or replace the registration and its TTL check (idempotent)."""
        ...

    def set_check(self, service_id: str, status: CheckStatus, note: str) -> None:
        """Set the TTL check of ``service_id``; ``passing`` also restarts its TTL."""
        ...

    def set_maintenance(self, service_id: str, reason: str | None) -> None:
        """Enter maintenance with ``reason``, or leave it when ``reason`` is None."""
        ...

    def deregister(self, service_id: str) -> None:
        """Remove the instance and its checks (idempotent)."""
        ...
