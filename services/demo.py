"""``llmq demo``: replay a slice of the Azure trace through the running stack.

Half of the requests go over the OpenAI-compatible HTTP API (streaming), half straight to
Kafka through the client SDK, each with the trace's prompt and output lengths (prompts are
filler text of about the right token count: the trace has sizes, not contents), a tenant
and a priority class drawn with a seeded RNG, and arrival times compressed to ``rate``
requests per second. At the end it prints latency by lane and priority, rejections by code
and the token throughput.

Trace: Azure LLM inference trace 2023 (Azure Public Dataset, CC-BY 4.0), Patel et al.,
"Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from aiokafka.errors import KafkaError

from llmq.client import LlmqClient
from schemas.replies import Done
from services.common.replies import StreamClosed
from services.sim.workload import TraceRequest, attach_classes, load_trace, scale_to_rate

LANE_THRESHOLD = 2000
#: What ends one request without ending the run: HTTP and socket errors, a timeout, a Kafka
#: error (a send that timed out) and a reply stream closed under it.
_REQUEST_FAILURES = (httpx.HTTPError, TimeoutError, OSError, KafkaError, StreamClosed)
_WORDS = ("alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta")


@dataclass(frozen=True, slots=True)
class Outcome:
    via: str
    lane: str
    priority: str
    ok: bool
    code: str | None
    ttft_s: float | None
    e2e_s: float
    completion_tokens: int


def filler(tokens: int, rng: random.Random) -> str:
    """About ``tokens`` tokens of text (≈ 4 bytes per token, as ingest estimates)."""
    words = []
    size = 0
    while size < tokens * 4:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


def plan(trace: Path, n: int, rate: float, seed: int, max_prompt: int,
         max_output: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    requests = load_trace(trace)[:n]
    requests = attach_classes(requests, rng, tenants=1)
    clipped = [
        TraceRequest(r.idx, r.arrival_s, min(max(r.prompt_tokens, 1), max_prompt),
                     min(max(r.output_tokens, 1), max_output), r.tenant, r.priority)
        for r in requests
    ]
    return scale_to_rate(clipped, rate)


async def _via_http(base_url: str, req: TraceRequest, prompt: str, model: str,
                    timeout_s: float) -> Outcome:
    lane = _lane(req)
    # Without include_usage a stream carries no usage, and its completion tokens would count 0.
    body = {"model": model, "prompt": prompt, "max_tokens": req.output_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "priority": req.priority,
            "timeout": timeout_s}
    start = time.monotonic()
    ttft = None
    tokens = 0
    async with httpx.AsyncClient(timeout=timeout_s + 10) as http, http.stream(
        "POST", f"{base_url}/v1/completions", json=body
    ) as resp:
        if resp.status_code != 200:
            code = _error_code(await resp.aread()) or str(resp.status_code)
            return Outcome("http", lane, req.priority, False, code, None,
                           time.monotonic() - start, 0)
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Outcome("http", lane, req.priority, False,
                               _error_code(line[6:].encode()) or "error", ttft,
                               time.monotonic() - start, tokens)
            if ttft is None:
                ttft = time.monotonic() - start
            usage = chunk.get("usage")
            if usage:
                tokens = usage.get("completion_tokens", tokens)
    return Outcome("http", lane, req.priority, True, None, ttft, time.monotonic() - start,
                   tokens)


async def _via_kafka(client: LlmqClient, req: TraceRequest, prompt: str,
                     timeout_s: float) -> Outcome:
    lane = _lane(req)
    start = time.monotonic()
    handle = await client.submit(prompt=prompt, max_tokens=req.output_tokens,
                                 priority=req.priority, timeout_s=timeout_s)
    ttft = None
    async for _chunk in handle:
        if ttft is None:
            ttft = time.monotonic() - start
    end = handle.result
    e2e = time.monotonic() - start
    if isinstance(end, Done):
        return Outcome("kafka", lane, req.priority, True, None, ttft, e2e,
                       end.usage.completion_tokens)
    return Outcome("kafka", lane, req.priority, False, end.code if end else "unknown", ttft,
                   e2e, 0)


def _error_code(body: bytes) -> str | None:
    """The ``error.code`` of an OpenAI-style error body; None for anything else (a
    proxy's HTML page, ``{"error": "text"}``): that request failed, the run goes on."""
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    error = payload.get("error") if isinstance(payload, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) and code else None


def _lane(req: TraceRequest) -> str:
    return "short" if req.prompt_tokens + req.output_tokens <= LANE_THRESHOLD else "long"


async def await_api(base_url: str, wait_s: float = 0.0) -> None:
    """Return once ``base_url`` answers; ``httpx.TransportError`` when nothing listens
    there, at once or after ``wait_s`` of trying (a stack just started: ingest listens
    only once it has recovered its tables, seconds after ``llmq up --detach`` returns)."""
    deadline = time.monotonic() + wait_s
    async with httpx.AsyncClient(timeout=10.0) as http:
        while True:
            try:
                await http.get(f"{base_url}/healthz")
                return
            except httpx.ConnectError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.5)


async def run_demo(bootstrap: str, prefix: str, base_url: str, requests: list[TraceRequest],
                   model: str, seed: int, timeout_s: float,
                   progress: Callable[[int, int], None] | None = None, *,
                   replication_factor: int = 1, wait_s: float = 0.0) -> dict[str, Any]:
    """Replay ``requests``; raises ``httpx.TransportError`` when nothing answers at
    ``base_url`` (at once, or after ``wait_s``: :func:`await_api`; the stack is not up:
    else half the run would wait out its timeouts). ``replication_factor``: of the
    tenant's reply topic, if the client has to make it."""
    await await_api(base_url, wait_s)
    rng = random.Random(seed)
    prompts = [filler(r.prompt_tokens, rng) for r in requests]
    outcomes: list[Outcome] = []
    started = time.monotonic()
    async with LlmqClient(bootstrap, prefix=prefix, default_model=model,
                          replication_factor=replication_factor) as client:

        async def one(i: int, req: TraceRequest) -> None:
            await asyncio.sleep(max(0.0, started + req.arrival_s - time.monotonic()))
            sent = time.monotonic()
            try:
                if i % 2 == 0:
                    out = await _via_http(base_url, req, prompts[i], model, timeout_s)
                else:
                    out = await _via_kafka(client, req, prompts[i], timeout_s)
            except _REQUEST_FAILURES as exc:  # that request failed; the run goes on
                out = Outcome("http" if i % 2 == 0 else "kafka", _lane(req), req.priority,
                              False, type(exc).__name__, None, time.monotonic() - sent, 0)
            outcomes.append(out)
            if progress is not None:
                progress(len(outcomes), len(requests))

        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return summarize(outcomes, time.monotonic() - started)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def summarize(outcomes: list[Outcome], elapsed_s: float) -> dict[str, Any]:
    groups: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        groups[f"lane={o.lane}"].append(o)
        groups[f"priority={o.priority}"].append(o)
        groups[f"via={o.via}"].append(o)
    table = {}
    for name, items in sorted(groups.items()):
        ok = [o for o in items if o.ok]
        table[name] = {
            "requests": len(items),
            "completed": len(ok),
            "ttft_p50_s": _pct([o.ttft_s for o in ok if o.ttft_s is not None], 50),
            "ttft_p99_s": _pct([o.ttft_s for o in ok if o.ttft_s is not None], 99),
            "e2e_p50_s": _pct([o.e2e_s for o in ok], 50),
            "e2e_p99_s": _pct([o.e2e_s for o in ok], 99),
        }
    tokens = sum(o.completion_tokens for o in outcomes)
    return {
        "requests": len(outcomes),
        "completed": sum(o.ok for o in outcomes),
        "rejections": dict(Counter(o.code for o in outcomes if not o.ok and o.code)),
        "elapsed_s": round(elapsed_s, 3),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / elapsed_s, 1) if elapsed_s > 0 else 0.0,
        "groups": table,
    }
