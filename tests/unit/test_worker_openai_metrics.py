"""What the ``openai`` engine makes of a vLLM server's /metrics: data-parallel pools add up,
and a value no real server reports is unknown load (fail closed), never a heartbeat the
wire refuses."""

from __future__ import annotations

import time
from dataclasses import asdict

import pytest

from schemas.workers import WorkerHeartbeat
from services.worker.core import heartbeat_fields
from services.worker.engines.openai import parse_vllm_metrics
from tests.unit.test_worker_openai import FakeServer, server, started

__all__ = ["server"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(60)

DP2 = ('vllm:kv_cache_usage_perc{engine="0"} 0.5\nvllm:kv_cache_usage_perc{engine="1"} 0.1\n'
       'vllm:gpu_cache_usage_perc{engine="0"} 0.5\nvllm:gpu_cache_usage_perc{engine="1"} 0.1\n'
       'vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_running{engine="1"} 3\n'
       'vllm:cache_config_info{engine="0",block_size="16",num_gpu_blocks="3000"} 1\n'
       'vllm:cache_config_info{engine="1",block_size="16",num_gpu_blocks="1000"} 1\n')


def test_data_parallel_pools_add_up_and_usage_is_weighted_by_blocks() -> None:
    load = parse_vllm_metrics(DP2)
    assert (load.num_gpu_blocks, load.block_size, load.running) == (4000, 16, 5)
    assert load.kv_usage == pytest.approx((0.5 * 3000 + 0.1 * 1000) / 4000)


def test_usage_without_every_engines_pool_is_averaged() -> None:
    load = parse_vllm_metrics('vllm:kv_cache_usage_perc{engine="0"} 0.2\n'
                              'vllm:kv_cache_usage_perc{engine="1"} 0.4\n'
                              'vllm:cache_config_info{engine="0",num_gpu_blocks="10"} 1\n')
    assert load.kv_usage == pytest.approx(0.3)
    assert load.num_gpu_blocks == 10


BOGUS = {
    "running past any count": "vllm:kv_cache_usage_perc 0.1\nvllm:num_requests_running 1e19\n",
    "negative waiting": "vllm:kv_cache_usage_perc 0.1\nvllm:num_requests_waiting -2\n",
    "block size past the wire": ('vllm:kv_cache_usage_perc 0.1\nvllm:cache_config_info'
                                 '{block_size="131072",num_gpu_blocks="1000"} 1\n'),
    "pool past any GPU": ('vllm:kv_cache_usage_perc 0.1\nvllm:cache_config_info'
                          '{block_size="16",num_gpu_blocks="99999999999999"} 1\n'),
}


@pytest.mark.parametrize("text", BOGUS.values(), ids=BOGUS.keys())
def test_values_no_server_reports_do_not_parse(text: str) -> None:
    with pytest.raises(ValueError):
        parse_vllm_metrics(text)


@pytest.mark.parametrize("text", BOGUS.values(), ids=BOGUS.keys())
async def test_a_bogus_scrape_is_unknown_load_and_the_heartbeat_still_builds(
        server: tuple[str, FakeServer], text: str) -> None:
    url, fake = server
    engine = await started(url, metrics_interval_s=3600)
    try:
        fake.metrics = text
        await engine.refresh_metrics()
        fields = heartbeat_fields(engine.capacity())
        assert fields.kv_free_tokens == 0  # unknown: fail closed
        now = time.time()
        WorkerHeartbeat(worker_id="w", engine="openai", model="m", model_version=None,
                        pool="any", role="mixed", partition=0, draining=False,
                        interval_s=1.0, started_at=now, seq=0, ts=now, renew=False,
                        **asdict(fields))
    finally:
        await engine.close()
