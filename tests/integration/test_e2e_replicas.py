"""Two scheduler replicas in the live stack, as ``llmq up --schedulers 2`` runs them: real
ingest, two real schedulers in one consumer group, real sim workers (2 short-pool + 1
long-pool, 20× simulated speed), the real broker, a unique topic prefix.

What the replicas must keep: every request answered once, both of them placing (each
takes its own request partitions, and the workers in turns); a replica killed -9 mid-load
loses nothing (the group hands its partitions to the other after its session times out).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmq.client import LlmqClient
from schemas.replies import Done
from services.common.settings import Settings
from services.stack import Stack, settings_env, stack_services
from tests.fakes.live_stack import StackProcs, loopback_config, wait_stack_ready
from tests.prefixes import unique_prefix

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(400)]

MODEL = "llama-3.1-8b"
REPLICAS = ("scheduler", "scheduler-2")


class ReplicaStack(StackProcs):
    def __init__(self, tmp: Path, bootstrap: str) -> None:
        self.prefix = unique_prefix("r")
        self.bootstrap = bootstrap
        self.settings = Settings(topic_prefix=self.prefix, assignment_partitions=8)
        self.cfg = loopback_config(time_scale=0.05, model=MODEL, schedulers=2)
        self.env = settings_env(self.settings)
        self.specs = stack_services(self.cfg)
        self.log_dir = tmp / "logs"
        self.stack = Stack(self.specs, self.env)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.cfg.http_port}"

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def placements(self, name: str) -> float:
        """``llmq_placements_total`` of one replica, from its own /metrics."""
        port = dict(self.spec(name).env)["LLMQ_METRICS_PORT"]
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        return sum(sample.value for family in text_string_to_metric_families(text)
                   if family.name == "llmq_placements" for sample in family.samples
                   if sample.name == "llmq_placements_total")

    def _both_in_turns(self, deadline: float) -> bool:
        return all("2 replica(s) in group" in self.log(name) for name in REPLICAS)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        wait_stack_ready(self.stack, self.base_url, self.log_dir, timeout_s,
                         also=self._both_in_turns)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, bootstrap: str) -> Iterator[ReplicaStack]:
    stack = ReplicaStack(tmp_path_factory.mktemp("replicas"), bootstrap)
    stack.stack.start(log_dir=stack.log_dir)
    try:
        stack.wait_ready()
        yield stack
    finally:
        stack.stack.stop(grace_s=20.0)


async def _submit_all(live: ReplicaStack, prompts: list[str]) -> list[object]:
    async with LlmqClient(live.bootstrap, prefix=live.prefix, default_model=MODEL) as client:
        handles = [await client.submit(prompt=p, max_tokens=16, timeout_s=120)
                   for p in prompts]
        return [end for _, end in [await h.wait() for h in handles]]


async def test_two_replicas_answer_every_request_and_both_place(live: ReplicaStack) -> None:
    before = {name: live.placements(name) for name in REPLICAS}
    ends = await _submit_all(live, [f"replica {i}" for i in range(48)])
    assert all(isinstance(e, Done) for e in ends), [e for e in ends if not isinstance(e, Done)]
    placed = {name: live.placements(name) - before[name] for name in REPLICAS}
    assert sum(placed.values()) >= 48 and all(placed.values()), placed  # both took a share
    for name in REPLICAS:
        assert "in this replica's turn" not in live.log(name)  # no turn placed twice


async def test_a_replica_killed_mid_load_loses_no_request(live: ReplicaStack) -> None:
    async with LlmqClient(live.bootstrap, prefix=live.prefix, default_model=MODEL) as client:
        handles = [await client.submit(prompt=f"before {i}", max_tokens=40, timeout_s=120)
                   for i in range(16)]
        seen = len(live.log("scheduler"))
        victim = live.proc("scheduler-2")
        victim.send_signal(signal.SIGKILL)
        await asyncio.to_thread(victim.wait, 10)
        killed_at = time.monotonic()
        handles += [await client.submit(prompt=f"after {i}", max_tokens=8, timeout_s=120)
                    for i in range(8)]
        ends = [end for _, end in [await h.wait() for h in handles]]
    assert all(isinstance(e, Done) for e in ends), [e for e in ends if not isinstance(e, Done)]
    # The survivor got the dead one's partitions once the group noticed (its session, 10 s)
    # and went on alone.
    since = live.log("scheduler")[seen:]
    assert "1 replica(s) in group" in since, since[-2000:]
    assert time.monotonic() - killed_at < 120
