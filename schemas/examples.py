"""One realistic, valid instance of every wire message, following one request end to end.

Used as the message examples of the AsyncAPI export, and by tests as the base of builders and
of the broker round trip. Deterministic: fixed ids and timestamps, no clock or randomness.
"""

from __future__ import annotations

from typing import Final, TypedDict

from schemas.base import WireMessage
from schemas.control import CancelRequest, DrainWorker, LeaseAnswer
from schemas.replies import Done, Error, Timings, TokenChunk, Usage
from schemas.requests import (
    AdmittedRequest,
    Assignment,
    ChatMessage,
    InferenceRequest,
    SamplingParams,
)
from schemas.status import QueueStatus
from schemas.topics import reply_topic
from schemas.workers import (
    EventAborted,
    EventDone,
    EventFailed,
    EventFirstToken,
    EventPrefilled,
    EventStarted,
    WorkerHeartbeat,
)

T0: Final = 1_700_000_000.0
REQUEST_ID: Final = "req-01HZX3K5Q7"
TENANT: Final = "acme"
WORKER_ID: Final = "worker-a100-0"
MODEL: Final = "meta-llama/Llama-3.1-8B-Instruct"


def example_request() -> InferenceRequest:
    return InferenceRequest(
        request_id=REQUEST_ID,
        tenant=TENANT,
        model=MODEL,
        messages=(
            ChatMessage(role="system", content="You are terse."),
            ChatMessage(role="user", content="Name three prime numbers."),
        ),
        max_tokens=64,
        sampling=SamplingParams(temperature=0.2, top_p=0.95, stop=("\n\n",), seed=7),
        priority="high",
        timeout_s=30.0,
        created_at=T0,
        prefix_hash="9f86d081884c7d65",
    )


def example_admitted() -> AdmittedRequest:
    return AdmittedRequest(
        request=example_request(),
        priority="high",
        lane="short",
        prompt_tokens=21,
        reply_topic=reply_topic("llmq", TENANT),
        admitted_at=T0 + 0.004,
    )


def example_assignment() -> Assignment:
    return Assignment(
        admitted=example_admitted(),
        worker_id=WORKER_ID,
        partition=3,
        attempt=1,
        kv_tokens=96,
        deadline=T0 + 30.0,
        assigned_at=T0 + 0.012,
        engine_priority=0,
        worker_started_at=T0 - 3600.0,
    )


def example_heartbeat() -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=WORKER_ID,
        engine="sim",
        model=MODEL,
        model_version="2024-07-23",
        pool="any",
        partition=3,
        kv_total_tokens=200_000,
        kv_free_tokens=150_000,
        # Llama-3-8B: 128 KiB of KV per token.
        kv_total_bytes=200_000 * 131_072,
        kv_free_bytes=150_000 * 131_072,
        block_size=16,
        vram_total_bytes=80 * 1024**3,
        vram_used_bytes=72 * 1024**3,
        gpu_util=0.83,
        running=12,
        waiting=2,
        max_num_seqs=256,
        draining=False,
        tokens_per_s=1830.5,
        interval_s=1.0,
        started_at=T0 - 3600.0,
        seq=3600,
        ts=T0,
    )


class _EventFields(TypedDict):
    request_id: str
    tenant: str
    attempt: int
    worker_id: str


_EVENT: Final[_EventFields] = {
    "request_id": REQUEST_ID,
    "tenant": TENANT,
    "attempt": 1,
    "worker_id": WORKER_ID,
}
_USAGE = Usage(prompt_tokens=21, completion_tokens=9)


def examples() -> tuple[WireMessage, ...]:
    """One instance of every message kind, in the order of ``MESSAGE_MODELS``."""
    return (
        example_request(),
        example_admitted(),
        example_assignment(),
        example_heartbeat(),
        EventStarted(**_EVENT, ts=T0 + 0.015),
        EventFirstToken(**_EVENT, ttft_s=0.061, ts=T0 + 0.061),
        EventPrefilled(
            **_EVENT,
            kv_transfer={"do_remote_prefill": True, "remote_engine_id": "prefill-0",
                         "remote_block_ids": [0, 1], "remote_host": "127.0.0.1",
                         "remote_port": 5600},
            prompt_tokens=21,
            ts=T0 + 0.030,
        ),
        EventDone(**_EVENT, finish_reason="stop", usage=_USAGE, ts=T0 + 0.140),
        EventFailed(
            **_EVENT,
            code="timeout",
            message="engine step exceeded the deadline",
            usage=_USAGE,
            ts=T0 + 30.0,
        ),
        EventAborted(**_EVENT, code="cancelled", ts=T0 + 0.090),
        TokenChunk(
            request_id=REQUEST_ID, attempt=1, seq=0, text="2, 3, 5", tokens=5, ts=T0 + 0.061
        ),
        Done(
            request_id=REQUEST_ID,
            attempt=1,
            model=MODEL,
            finish_reason="stop",
            usage=_USAGE,
            timings=Timings(queued_s=0.015, ttft_s=0.061, e2e_s=0.140),
            ts=T0 + 0.140,
        ),
        Error(
            request_id=REQUEST_ID,
            attempt=0,
            code="rate_limited",
            message="tenant acme is over its tokens-per-minute limit",
            retry_after_s=2.5,
            ts=T0 + 0.003,
        ),
        DrainWorker(
            worker_id=WORKER_ID, reason="kernel upgrade", issued_by="cli", issued_at=T0 + 60.0
        ),
        CancelRequest(
            request_id=REQUEST_ID,
            tenant=TENANT,
            reason="client disconnected",
            issued_by="ingest",
            issued_at=T0 + 0.080,
        ),
        LeaseAnswer(
            worker_id=WORKER_ID,
            started_at=T0 - 3600.0,
            seq=3601,
            granted=True,
            issued_by="scheduler-1",
            issued_at=T0 + 1.2,
        ),
        QueueStatus(
            model=MODEL,
            scheduler_id="scheduler-1",
            pending_requests=42,
            pending_tokens=61_440,
            running_tokens=250_000,
            drain_tokens_per_s=18_500.0,
            live_workers=3,
            max_usable_kv_tokens=440_000,
            ts=T0,
        ),
    )
