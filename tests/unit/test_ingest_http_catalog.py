"""``GET /v1/models`` and ``GET /readyz``, driven through the ASGI app: the model list hides
what the tenant may not use (by admission's rule), and readiness needs a live worker now,
not any heartbeat ever read.

The gateway is the real one, never started (no lifespan under ``ASGITransport``); the
watcher is a stand-in around a real :class:`ClusterTracker`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from services.ingest.cluster import ClusterTracker, Freshness
from services.ingest.http import HttpDeps, create_api
from services.ingest.http.gateway import Gateway
from services.ingest.http.openai import ApiDefaults
from services.ingest.tenants import Tenancy, hash_api_key, load_tenancy
from services.ingest.topics import IngestTopics
from tests.builders_schemas import make_heartbeat

NOW = 1_700_000_000.0
TOPICS = IngestTopics.of("llmq", "llmq-ingest", "a")

TENANTS = f"""
[tenants.acme]
api_key_sha256 = "{hash_api_key("acme-key")}"
rpm = 600
tpm = 200000
max_concurrency = 32

[tenants.beta]
api_key_sha256 = "{hash_api_key("beta-key")}"
rpm = 600
tpm = 200000
max_concurrency = 32
allowed_models = ["public-model", "llama-3.1-8b"]
"""


def api(tenancy: Tenancy, tracker: ClusterTracker,
        clock: Callable[[], float] = lambda: NOW) -> httpx.AsyncClient:
    watcher = SimpleNamespace(tracker=tracker, running=True, caught_up=asyncio.Event())
    app = create_api(HttpDeps(
        gateway=Gateway("127.0.0.1:9", TOPICS, instance_id="a"),  # never connects
        tenancy=tenancy, watcher=watcher,  # type: ignore[arg-type]  # stand-in watcher
        defaults=ApiDefaults(), reply_grace_s=1.0, clock=clock,
    ))
    # An exception the app lets out reaches the server (as under uvicorn), not the test.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://ingest")


def serving(tenancy: Tenancy, *models: str, ts: float = NOW) -> ClusterTracker:
    tracker = ClusterTracker(tenancy.config.admission.registry, Freshness())
    for i, model in enumerate(models):
        tracker.observe_heartbeat(make_heartbeat(worker_id=f"w-{i}", model=model, ts=ts))
    return tracker


@pytest.fixture
def keyed(tmp_path: Path) -> Tenancy:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    return load_tenancy(path)


@pytest.mark.parametrize(("key", "listed"), [
    ("acme-key", ["acme-private-finetune", "meta-llama/Llama-3.1-8B-Instruct",
                  "public-model"]),
    # Allowed by its registry name, served under an alias: listed, as admission admits it.
    ("beta-key", ["meta-llama/Llama-3.1-8B-Instruct", "public-model"]),
])
async def test_models_lists_only_what_the_tenant_may_use(
    keyed: Tenancy, key: str, listed: list[str],
) -> None:
    tracker = serving(keyed, "public-model", "acme-private-finetune",
                      "meta-llama/Llama-3.1-8B-Instruct")
    async with api(keyed, tracker) as client:
        r = await client.get("/v1/models", headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == listed


async def test_models_needs_a_key(keyed: Tenancy) -> None:
    async with api(keyed, serving(keyed, "public-model")) as client:
        r = await client.get("/v1/models")
    assert r.status_code == 401


@pytest.mark.parametrize(("ts", "ready"), [
    (NOW, True),
    (NOW - 86_400, False),  # a day-old beat replayed from the compacted topic
])
async def test_readyz_waits_for_a_live_worker_at_start(ts: float, ready: bool) -> None:
    tenancy = load_tenancy(None)
    tracker = serving(tenancy, "m", ts=ts)
    assert tracker.heartbeats_seen == 1
    async with api(tenancy, tracker) as client:
        r = await client.get("/readyz")
    assert r.json()["checks"]["worker_heartbeat"] is ready
    assert any("no live worker" in why for why in r.json()["reasons"]) is not ready


async def test_readyz_stays_ready_once_a_live_worker_was_seen() -> None:
    # A fleet drained or lagging later is answered 503 overloaded (with Retry-After) by
    # every instance; unready, a load balancer would drop them all.
    tenancy = load_tenancy(None)
    tracker = serving(tenancy, "m", ts=NOW)
    clock = [NOW]
    async with api(tenancy, tracker, clock=lambda: clock[0]) as client:
        assert (await client.get("/readyz")).json()["checks"]["worker_heartbeat"]
        clock[0] = NOW + 3_600  # the worker's beat is an hour old now
        assert (await client.get("/readyz")).json()["checks"]["worker_heartbeat"]


async def test_a_wrong_method_is_405_in_openai_shape_with_allow() -> None:
    tenancy = load_tenancy(None)
    async with api(tenancy, serving(tenancy, "m")) as client:
        r = await client.get("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"  # RFC 9110 wants Allow
    assert r.json()["error"]["message"] == "Method Not Allowed"


class _Broken(ClusterTracker):
    def served_models(self, now: float) -> list[str]:
        raise RuntimeError("a bug")


async def test_a_bug_is_a_500_in_openai_shape_not_plain_text() -> None:
    tenancy = load_tenancy(None)
    async with api(tenancy, _Broken(tenancy.config.admission.registry)) as client:
        r = await client.get("/v1/models")
    assert r.status_code == 500
    assert r.json()["error"] == {
        "message": "internal error in llmq ingest (RuntimeError); see its log",
        "type": "server_error", "param": None, "code": "internal_error"}


async def test_the_apis_own_refusals_are_counted(keyed: Tenancy) -> None:
    """Found by an audit of the metrics: a 401, or a 503 while Kafka is out of reach (the
    gateway here never connects), changed no metric: llmq_requests_total stayed flat
    while every call failed."""
    from services.common.metrics import REGISTRY

    def answered(status: int) -> float:
        return REGISTRY.get_sample_value("llmq_http_responses_total",
                                         {"status": str(status)}) or 0.0

    before = {status: answered(status) for status in (401, 503)}
    body = {"model": "public-model", "messages": [{"role": "user", "content": "hi"}]}
    async with api(keyed, serving(keyed, "public-model")) as client:
        no_key = await client.post("/v1/chat/completions", json=body)
        no_kafka = await client.post("/v1/chat/completions", json=body,
                                     headers={"authorization": "Bearer acme-key"})
    assert (no_key.status_code, no_kafka.status_code) == (401, 503)
    assert {status: answered(status) - before[status] for status in before} == {401: 1, 503: 1}
