"""``llmq top --once --json`` on the whole live stack: real ingest, scheduler, health and
sim workers (20× speed) on free loopback ports, a unique topic prefix and a temporary
LLMQ_HOME whose services.json lists their real metrics endpoints.

Traffic runs in a thread while ``top`` measures its window, so every rate it shows must be
positive: completed requests, generated tokens, 429s of a tenant limited to 1 request a
minute, placements; and its latency percentiles come from the workers' and the
scheduler's real histograms.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from services.common.settings import Settings
from services.ops.top import top
from services.stack import Stack, settings_env, stack_services, write_services_file
from tests.fakes.live_stack import loopback_config, wait_stack_ready, write_tenants_file
from tests.prefixes import unique_prefix

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(240)]

MODEL = "llama-3.1-8b"


class LiveStack:
    def __init__(self, tmp: Path) -> None:
        self.settings = Settings(topic_prefix=unique_prefix("top"),
                                 assignment_partitions=8, home=tmp)
        cfg = loopback_config(time_scale=0.05, model=MODEL)
        self.http_port = cfg.http_port
        specs = stack_services(cfg)
        env = settings_env(self.settings) | {
            "LLMQ_TENANTS_FILE": str(write_tenants_file(tmp / "tenants.toml")),
            "LLMQ_HEALTH_LAG_S": "0.5",
        }
        self.log_dir = tmp / "logs"
        self.stack = Stack(specs, env)
        self.base_url = f"http://127.0.0.1:{self.http_port}"

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        wait_stack_ready(self.stack, self.base_url, self.log_dir, timeout_s)

    def chat(self, key: str = "open-key") -> int:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 16}
        resp = httpx.post(f"{self.base_url}/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {key}"})
        return resp.status_code


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, bootstrap: str) -> Iterator[LiveStack]:
    stack = LiveStack(tmp_path_factory.mktemp("top-stack"))
    stack.stack.start(log_dir=stack.log_dir)
    try:
        write_services_file(stack.settings, stack.stack)
        stack.wait_ready()
        yield stack
    finally:
        stack.stack.stop(grace_s=20.0)


def _traffic(live: LiveStack, stop: threading.Event, codes: list[int]) -> None:
    while not stop.is_set():
        codes.append(live.chat())
        codes.append(live.chat("limited-key"))


async def test_top_once_on_the_live_stack(live: LiveStack) -> None:
    assert live.chat() == 200  # warm: every histogram has an observation before top starts
    stop = threading.Event()
    codes: list[int] = []
    sender = threading.Thread(target=_traffic, args=(live, stop, codes), daemon=True)
    sender.start()
    try:
        result = await asyncio.to_thread(
            CliRunner().invoke, top, ["--once", "--json", "--interval", "3"], obj=live.settings)
    finally:
        stop.set()
        sender.join(60)
    assert result.exit_code == 0, result.output
    frame: dict[str, Any] = json.loads(result.output)
    assert 200 in codes and 429 in codes

    assert frame["kafka"]["ok"]
    assert frame["status"]["summary"]["up"] == 3
    endpoints = {e["name"]: e for e in frame["endpoints"]}
    assert set(endpoints) == {"scheduler", "ingest", "health", "worker-0", "worker-1",
                              "worker-2"}
    assert all(e["ok"] for e in endpoints.values()), endpoints

    rates = frame["rates"]
    for key in ("requests_per_s", "done_per_s", "tokens_per_s", "rejected_429_per_s",
                "placements_per_s", "admitted_tokens_per_s"):
        assert rates[key] is not None and rates[key] > 0, (key, rates)
    for key in ("ttft", "e2e", "queue_wait", "decision"):
        total = frame["latency"][key]["total"]
        assert total["count"] >= 1 and total["p50"] is not None, (key, total)
    assert len(frame["classes"]) == 6
    assert sum(c["placed"] for c in frame["classes"]) > 0
    assert not [line for line in frame["missing"] if "no answering endpoint" not in line], (
        frame["missing"])
