"""The llmq client SDK: submit requests to Kafka and iterate their replies.

``from llmq.client import LlmqClient`` — see :mod:`llmq.client`. The services live in
``services/``, the wire models in ``schemas/``.
"""
