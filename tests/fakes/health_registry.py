"""FAKE registry for the health service tests: an in-memory stand-in for a Consul agent.

Implements :class:`services.health.registry.Registry` with the agent's behaviour that the
health service relies on: registering replaces an instance and resets its check to
critical (Consul's initial TTL status), checks and maintenance of unknown instances fail,
deregistering an unknown instance is fine, and ``forget()`` simulates an agent restart
(everything gone). ``fail_next`` makes the next calls raise ``RegistryError``. Every call
is recorded in ``calls`` so tests can assert what was (not) done.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.health.registry import CheckStatus, RegistryError, ServiceRegistration


@dataclass
class FakeInstance:
    registration: ServiceRegistration
    check: CheckStatus = "critical"
    note: str = ""
    passes: int = 0
    maintenance: str | None = None


class InMemoryRegistry:
    """In-memory fake of a Consul agent (see the module docstring)."""

    def __init__(self) -> None:
        self.instances: dict[str, FakeInstance] = {}
        self.calls: list[tuple[str, str]] = []
        self.fail_next = 0

    def _call(self, op: str, service_id: str) -> None:
        self.calls.append((op, service_id))
        if self.fail_next:
            self.fail_next -= 1
            raise RegistryError(f"fake registry: {op} {service_id} failed on purpose")

    def _get(self, service_id: str) -> FakeInstance:
        try:
            return self.instances[service_id]
        except KeyError:
            raise RegistryError(f"fake registry: unknown service {service_id}") from None

    def service_ids(self, name: str) -> set[str]:
        self._call("list", name)
        return {sid for sid, inst in self.instances.items() if inst.registration.name == name}

    def register(self, reg: ServiceRegistration) -> None:
        self._call("register", reg.service_id)
        # A registration with replace-existing-checks may drop the maintenance check (its
        # own check in Consul): the fake takes the stricter reading, so the reconciler
        # must set maintenance again after every registration.
        self.instances[reg.service_id] = FakeInstance(reg)

    def set_check(self, service_id: str, status: CheckStatus, note: str) -> None:
        self._call(f"check:{status}", service_id)
        inst = self._get(service_id)
        inst.check, inst.note = status, note
        inst.passes += status == "passing"

    def set_maintenance(self, service_id: str, reason: str | None) -> None:
        self._call("maintenance:on" if reason else "maintenance:off", service_id)
        self._get(service_id).maintenance = reason

    def deregister(self, service_id: str) -> None:
        self._call("deregister", service_id)
        self.instances.pop(service_id, None)

    def forget(self) -> None:
        """Simulate a Consul agent restart: every registration is lost."""
        self.instances.clear()

    def ops(self, service_id: str) -> list[str]:
        """The operations done on one service id, in order."""
        return [op for op, sid in self.calls if sid == service_id]
