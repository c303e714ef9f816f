"""ingest.http: the OpenAI-compatible API in front of llmq.intake.

Owns the HTTP surface only: API key → tenant (:mod:`services.ingest.tenants`), OpenAI body →
``InferenceRequest`` (:mod:`.openai`), errors in OpenAI's shape (:mod:`.errors`), and the
Kafka edge of one instance (:mod:`.gateway`: produce to intake, read the instance's reply
topic, send cancels). It decides nothing: admission happens in the Faust agents
(``services.ingest.app``) for HTTP and Kafka clients alike. Built by
``services.ingest.__main__`` via :func:`create_api`.
"""

from services.ingest.http.routes import HttpDeps, create_api

__all__ = ["HttpDeps", "create_api"]
