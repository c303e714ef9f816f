"""The py-consul adapter of :class:`services.health.registry.Registry`.

Talks to a Consul *agent* (the local one, by Consul's design): services registered here
live on that agent, each with one TTL check whose id Consul derives as
``service:<service_id>``. Every call is a blocking HTTP request; the health service calls
them from a worker thread. Any failure (agent down, ACL refusal, unknown check after an
agent restart) becomes :class:`RegistryError`, on which the service re-registers.

Tested against a real ``consul agent -dev`` when a ``consul`` binary is on PATH
(tests/integration/test_health_consul.py); no Consul server can be installed on the
project's build machines, so there the test is skipped with that reason.
"""

from __future__ import annotations

from typing import Any

import consul
import requests

from services.health.registry import CheckStatus, RegistryError, ServiceRegistration
from services.health.settings import ConsulAddress


def check_id(service_id: str) -> str:
    """Id Consul gives the single check registered with a service."""
    return f"service:{service_id}"


class ConsulRegistry:
    """Registrations on one Consul agent (see the module docstring)."""

    def __init__(
        self, addr: ConsulAddress, token: str | None = None, timeout_s: float = 5.0
    ) -> None:
        self.addr = addr
        self._client: Any = consul.Consul(
            host=addr.host, port=addr.port, scheme=addr.scheme, token=token,
            connections_timeout=timeout_s,
        )

    def service_ids(self, name: str) -> set[str]:
        services: dict[str, Any] = self._call(self._client.agent.services)
        return {sid for sid, svc in services.items() if svc.get("Service") == name}

    def register(self, reg: ServiceRegistration) -> None:
        ok = self._call(
            self._client.agent.service.register,
            reg.name,
            service_id=reg.service_id,
            address=reg.address,
            port=reg.port,
            tags=list(reg.tags),
            meta=dict(reg.meta) or None,
            check=consul.Check.ttl(_duration(reg.ttl_s)),
            # Replace, not merge, the checks of a re-registration (idempotent register).
            replace_existing_checks=True,
        )
        _ensure(ok, f"register {reg.service_id}")

    def set_check(self, service_id: str, status: CheckStatus, note: str) -> None:
        call = (self._client.agent.check.ttl_pass if status == "passing"
                else self._client.agent.check.ttl_fail)
        _ensure(self._call(call, check_id(service_id), notes=note), f"check {service_id}")

    def set_maintenance(self, service_id: str, reason: str | None) -> None:
        ok = self._call(self._client.agent.service.maintenance, service_id,
                        reason is not None, reason=reason)
        _ensure(ok, f"maintenance {service_id}")

    def deregister(self, service_id: str) -> None:
        # False is Consul's 404 (unknown service id): already gone, which is what we want.
        self._call(self._client.agent.service.deregister, service_id)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (consul.ConsulException, requests.RequestException, OSError) as exc:
            raise RegistryError(f"consul at {self.addr.host}:{self.addr.port}: {exc}") from exc


def _duration(seconds: float) -> str:
    """Consul duration text; whole milliseconds so any TTL survives the round trip."""
    return f"{round(seconds * 1000)}ms"


def _ensure(ok: Any, what: str) -> None:
    # py-consul's boolean callbacks return False, without raising, when the agent answered
    # 404 (unknown service or check, e.g. after an agent restart): a failure here.
    if ok is False:
        raise RegistryError(f"consul refused: {what}")
