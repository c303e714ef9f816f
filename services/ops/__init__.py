"""Operator commands over the live system: ``llmq status`` and ``llmq drain``.

Owns the logic the CLI calls — plain async functions that return data — and their click
commands (:mod:`services.ops.cli`, registered by ``services/cli.py``):

- :func:`services.ops.status.cluster_status`: workers and their states, queue status per
  model, depth and consumer lag per topic, metrics URLs (also served by the health
  service's ``/status``);
- :func:`services.ops.drain.request_drain`: send ``DrainWorker`` and optionally follow the
  worker's heartbeats until it has drained.

Worker states come from :mod:`services.health.core`, so the CLI and the health service
never disagree. Everything here reads Kafka; nothing here creates topics or groups.
"""
