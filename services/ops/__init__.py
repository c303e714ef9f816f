"""Operator commands over the live system: ``llmq status``, ``llmq drain``, ``llmq top``.

Owns the logic the CLI calls — plain async functions that return data — and their click
commands (:mod:`services.ops.cli`, registered by ``services/cli.py``):

- :func:`services.ops.status.cluster_status`: workers and their states, queue status per
  model, depth and consumer lag per topic, metrics URLs (also served by the health
  service's ``/status``);
- :func:`services.ops.drain.request_drain`: send ``DrainWorker`` and optionally follow the
  worker's heartbeats until it has drained;
- :mod:`services.ops.top`: ``llmq top``, the status document joined with rates and latency
  percentiles scraped from the services' /metrics (:mod:`services.ops.top_frame`,
  :mod:`services.ops.promtext`), live in the terminal.
- :mod:`services.ops.params`: click types every ``llmq`` command uses for numbers that
  must be finite and in range (``nan`` included), refused before anything is sent.

Worker states come from :mod:`services.health.core`, so the CLI and the health service
never disagree. Everything here reads Kafka; nothing here creates topics or groups.
"""
