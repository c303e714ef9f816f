"""The ``openai`` engine refuses to start against a server that certainly does not serve
its model at its URL, and starts against one it cannot ask (down, loading, no list)."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from services.worker.engines.base import EngineMisconfigured
from services.worker.engines.openai import OpenAIEngine
from services.worker.engines.sim.profiles import get_profile
from tests.fakes.http_server import serving

pytestmark = pytest.mark.timeout(60)

PROFILE = get_profile("llama3-8b-h100")


def _app(models: Any, status: int = 200) -> Starlette:
    async def listing(_: Request) -> Response:
        return JSONResponse(models, status_code=status)

    return Starlette(routes=[Route("/v1/models", listing)])


async def _start(url: str, model: str = "m") -> OpenAIEngine:
    engine = OpenAIEngine(url, model, profile=PROFILE, metrics_interval_s=3600)
    await engine.start()
    return engine


async def test_a_url_ending_in_v1_is_refused_saying_to_drop_it() -> None:
    async with serving(_app({"object": "list", "data": [{"id": "m"}]})) as url:
        with pytest.raises(EngineMisconfigured, match="drop /v1 from --openai-url"):
            await _start(url + "/v1")


async def test_a_model_the_server_does_not_list_is_refused_naming_what_it_serves() -> None:
    async with serving(_app({"object": "list", "data": [{"id": "llama"}]})) as url:
        with pytest.raises(EngineMisconfigured, match=r"serves \['llama'\], not 'm'"):
            await _start(url, "m")


async def test_the_listed_model_starts() -> None:
    async with serving(_app({"object": "list", "data": [{"id": "x"}, {"id": "m"}]})) as url:
        engine = await _start(url)
        await engine.close()


@pytest.mark.parametrize(("models", "status"), [
    ({"error": "loading"}, 503),   # still loading
    ({"detail": "Not Found"}, 404),  # no model list at a plain URL
    (["not", "a", "list"], 200),
])
async def test_a_server_that_cannot_be_asked_is_let_be(models: Any, status: int) -> None:
    async with serving(_app(models, status)) as url:
        engine = await _start(url)
        await engine.close()


async def test_a_mounted_server_under_v1_paths_still_starts() -> None:
    # A gateway whose base URL ends in /v1 and that does serve /v1/v1/models is fine.
    inner = _app({"object": "list", "data": [{"id": "m"}]})
    async with serving(Starlette(routes=[Mount("/v1", app=inner)])) as url:
        engine = await _start(url + "/v1")
        await engine.close()
