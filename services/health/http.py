"""The health service's HTTP endpoints (FastAPI, on 127.0.0.1 only).

- ``GET /healthz``: 200 while the process runs (liveness);
- ``GET /readyz``: 200 when Kafka answered the last probe and the heartbeats topic was read
  to its end, else 503; the body says which part is missing;
- ``GET /status[?group=G]``: the ``llmq status --json`` document
  (:mod:`services.ops.status`); 503 with ``{"error": ...}`` when Kafka cannot be read, and
  503 with ``{"error": ..., "heartbeats_caught_up": false}`` until the heartbeats topic
  was read to its end (fail closed: an empty or partial fleet is not an answer).
"""

from __future__ import annotations

import logging
from typing import Any

from aiokafka.errors import KafkaError
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from services.health.service import FleetNotRead, HealthService

_log = logging.getLogger(__name__)


def create_app(service: HealthService) -> FastAPI:
    app = FastAPI(title="llmq health", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        body = service.readiness()
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/status")
    async def status(group: str | None = None) -> JSONResponse:
        try:
            doc = await service.status(group)
        except FleetNotRead as exc:
            return JSONResponse({"error": str(exc), "heartbeats_caught_up": False},
                                status_code=503)
        except (KafkaError, OSError, TimeoutError) as exc:
            _log.warning("health: /status failed: %r", exc)
            return JSONResponse({"error": f"cannot read Kafka: {exc!r}"}, status_code=503)
        return JSONResponse(doc)

    return app
