"""The health service's HTTP endpoints over ASGI (no socket, no Kafka): /status fails closed
until the heartbeats topic was read to its end."""

from __future__ import annotations

import httpx
import pytest

from services.common.settings import Settings
from services.health.http import create_app
from services.health.service import FleetNotRead, HealthService
from services.health.settings import HealthSettings
from tests.fakes.heartbeat_worker import heartbeat


def _service() -> HealthService:
    # A bootstrap nothing answers on: these requests must not need Kafka at all.
    settings = Settings(topic_prefix="unit", kafka_bootstrap="127.0.0.1:1")
    svc = HealthService(settings, HealthSettings(port=18999, instance_id="test"))
    svc.tracker.observe_heartbeat(heartbeat("w1", ts=1.0, started_at=0.0, seq=1))
    return svc


async def test_status_is_503_until_the_heartbeats_were_read_to_their_end() -> None:
    transport = httpx.ASGITransport(app=create_app(_service()))
    async with httpx.AsyncClient(transport=transport, base_url="http://health") as client:
        response = await client.get("/status")
    assert response.status_code == 503
    body = response.json()
    assert body["heartbeats_caught_up"] is False
    assert "still reading unit.heartbeats" in body["error"]


async def test_the_service_refuses_a_fleet_it_has_not_read() -> None:
    with pytest.raises(FleetNotRead, match="the fleet is not known yet"):
        await _service().status()
