"""The llmq worker: one inference engine behind one partition of ``llmq.assignments``.

Owns continuous batching (the engine's), token streaming, per-request timeouts and aborts,
dedupe of stale attempts, and heartbeats (KV/VRAM capacity, queue depth). Layout:

- ``core/``: pure pieces (chunk batching, dedupe, deadlines, commit offsets, heartbeat
  fields, throughput), no I/O;
- ``engines/``: the ``Engine`` protocol (``base``), the registry, and the ``sim``,
  ``openai`` and ``vllm`` engines;
- ``runner``: one request from ``event.started`` to its terminal reply;
- ``app``: the Kafka wiring (consume, control, heartbeats, commits, drain); ``slot``: the
  one-worker-per-slot lock; ``kafka_io``, ``gpu``, ``metrics``, ``settings``;
- ``__main__``: ``python -m services.worker``.

Only the worker's own entry point and the simulator (``engines.sim``) import from here.
"""
