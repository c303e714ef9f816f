"""The health service: worker liveness as seen from ``llmq.heartbeats``, mirrored into Consul.

Owns (DESIGN.md, service table): Consul registrations and TTL checks of the workers, Consul
maintenance for draining workers, the process probes ``/healthz`` and ``/readyz``, the
cluster status endpoint ``/status`` and the fleet gauges on ``LLMQ_METRICS_PORT``.

Kafka heartbeats are the source of truth; Consul is an optional mirror (``LLMQ_CONSUL_ADDR``).
Without Consul the service runs the same, minus the mirror.

Modules:

- :mod:`~services.health.core`: pure rules — worker state from a heartbeat and ``now``,
  desired registrations, and the reconcile plan (data) that brings a registry there;
- :mod:`~services.health.registry`: the ``Registry`` Protocol the plan is applied to;
- :mod:`~services.health.consul_registry`: its py-consul adapter;
- :mod:`~services.health.fleet`: newest heartbeat per worker (plain state) and the Kafka feed
  that fills it;
- :mod:`~services.health.service`, :mod:`~services.health.http`,
  :mod:`~services.health.metrics`, ``__main__``: the running process.

Callers: ``python -m services.health``; :mod:`services.ops` (``llmq status`` / ``llmq drain``)
reuses the core rules and the fleet feed so that the CLI and the service agree on states.
"""
