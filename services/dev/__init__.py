"""Developer conveniences: the embedded Kafka broker (and, later, Jaeger) on loopback.

Called by the CLI (``llmq dev ...``), ``make up`` and ``make test``; services never import it.
"""
