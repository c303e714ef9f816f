"""The llmq worker: one inference engine behind one partition of ``llmq.assignments``.

Owns continuous batching, token streaming, per-request timeouts and aborts, dedupe of
stale attempts, and heartbeats (KV/VRAM capacity, queue depth). ``engines/`` holds the
engine implementations (``sim``, ``vllm``, ``openai``); the Kafka wiring lives in
``app.py``. Only the worker's own app and the simulator import from here.
"""
