"""``python -m services.worker``: one worker process on one slot.

Settings are read here, once: ``LLMQ_*`` (shared), ``LLMQ_WORKER_*`` and
``LLMQ_METRICS_PORT`` (see :mod:`services.worker.settings`); flags override them.
Tracing: ``LLMQ_OTLP_ENDPOINT`` / ``LLMQ_TRACE_SAMPLE_RATIO`` (off when unset).

Signals: the first SIGTERM/SIGINT drains (finish in-flight work, exit 0); a second one
stops at once (exit 1; unfinished requests are redone after a restart or requeued by the
scheduler). Exit status 2: bad configuration, or the slot is held by another worker.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from aiokafka.errors import KafkaError
from pydantic import ValidationError

from services.common import tracing
from services.common.settings import Settings, warn_unknown_env
from services.worker.app import Worker, WorkerIdentity
from services.worker.engines.base import EngineMisconfigured
from services.worker.engines.registry import EngineConfig, build_engine, check_role
from services.worker.engines.sim.profiles import get_profile
from services.worker.settings import WorkerSettings
from services.worker.slot import SlotRefused

_log = logging.getLogger("services.worker")


def _parse(argv: Sequence[str] | None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        prog="python -m services.worker",
        description="llmq worker: one engine behind one partition (slot) of llmq.assignments.",
    )
    p.add_argument("--slot", type=int, help="partition of <prefix>.assignments to own "
                   "(LLMQ_WORKER_SLOT)")
    p.add_argument("--pool", choices=("short", "long", "any"), help="lanes taken")
    p.add_argument("--role", choices=("mixed", "prefill", "decode"),
                   help="mixed (default): requests whole; prefill: prompts, their KV handed "
                   "to a decode worker; decode: hand-offs (LLMQ_WORKER_ROLE)")
    p.add_argument("--engine", choices=("sim", "openai", "vllm"), help="engine (default sim)")
    p.add_argument("--profile", help="engine profile name (default llama3-8b-h100)")
    p.add_argument("--profile-file", dest="profile_file", help="extra profiles TOML")
    p.add_argument("--model", help="model name served (default: the profile's model)")
    p.add_argument("--model-version", dest="model_version")
    p.add_argument("--worker-id", dest="worker_id", help="default <host>-slot<N>")
    p.add_argument("--openai-url", dest="openai_url", help="openai engine: server base URL")
    p.add_argument("--openai-model", dest="openai_model",
                   help="openai engine: model name on the server (default --model)")
    p.add_argument("--scheduling-policy", dest="scheduling_policy",
                   choices=("priority", "fcfs"),
                   help="order of requests the engine has not started: by class, then "
                   "arrival (default; vLLM's --scheduling-policy priority), or arrival only")
    p.add_argument("--time-scale", dest="time_scale", type=float,
                   help="sim engine: real seconds per simulated second (default 1.0)")
    p.add_argument("--heartbeat-interval", dest="heartbeat_interval_s", type=float,
                   help="seconds between heartbeats (default 1.0; the scheduler declares a "
                   "worker dead after 3 of them)")
    p.add_argument("--lease-beats", dest="lease_beats", type=float,
                   help="answer work only while the newest acknowledged heartbeat is younger "
                   "than this many intervals, else fence (default 2.75; keep it under the "
                   "scheduler's heartbeat_staleness, 3)")
    p.add_argument("--lease-ask-beats", dest="lease_ask_beats", type=float,
                   help="once the lease lapses, hold output and ask the scheduler for up to "
                   "this many intervals whether the work is still ours, then fence "
                   "(default 2; 0 fences at once)")
    p.add_argument("--chunk-tokens", dest="chunk_tokens", type=int,
                   help="flush a chunk every N tokens (default 16)")
    p.add_argument("--chunk-ms", dest="chunk_ms", type=float,
                   help="... or after M milliseconds (default 50)")
    p.add_argument("--max-in-flight", dest="max_in_flight", type=int,
                   help="requests in the engine at once (default its max_num_seqs)")
    p.add_argument("--handoff-hold", dest="handoff_hold_s", type=float,
                   help="prefill role: a drain waits up to this many seconds after each "
                   "hand-off for its decode stage to take the prompt's KV (default 120; "
                   "match the KV connector's timeout; 0: no wait)")
    p.add_argument("--metrics-port", dest="metrics_port", type=int,
                   help="Prometheus port on 127.0.0.1 (LLMQ_METRICS_PORT)")
    p.add_argument("--loglevel", dest="log_level",
                   choices=("debug", "info", "warning", "error"))
    args = vars(p.parse_args(argv))
    return {name: value for name, value in args.items() if value is not None}


def build(overrides: dict[str, Any]) -> Worker:
    """Settings → engine → worker. ValueError / ValidationError on bad configuration."""
    settings = Settings()
    ws = WorkerSettings(**overrides)
    profile = get_profile(ws.profile, ws.profile_file)
    model = ws.model or profile.model
    engine = build_engine(EngineConfig(
        kind=ws.engine, model=model, profile=profile, time_scale=ws.time_scale,
        seed=ws.seed, openai_url=ws.openai_url, openai_model=ws.openai_model,
        openai_api_key=ws.openai_api_key, metrics_interval_s=ws.heartbeat_interval_s,
        vllm_args=ws.vllm_args, scheduling_policy=ws.scheduling_policy,
    ))
    check_role(ws.role, engine)
    identity = WorkerIdentity(
        worker_id=ws.resolved_worker_id(), slot=ws.slot, pool=ws.pool, model=model,
        model_version=ws.model_version, engine=engine.name, role=ws.role,
    )
    return Worker(settings, ws, engine, identity)


async def _serve(worker: Worker) -> int:
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal(name: str) -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            worker.begin_drain(name)
        else:
            worker.stop_now()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    return await worker.run()


def main(argv: Sequence[str] | None = None) -> int:
    overrides = _parse(argv)
    warn_unknown_env("worker", WorkerSettings, os.environ)
    try:
        worker = build(overrides)
    except (ValidationError, ValueError) as exc:
        print(f"worker: invalid configuration: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=worker.ws.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    settings = worker.settings
    tracing.setup("llmq-worker", settings.otlp_endpoint, settings.trace_sample_ratio)
    try:
        return asyncio.run(_serve(worker))
    except (SlotRefused, EngineMisconfigured) as exc:
        print(f"worker: refusing to start: {exc}", file=sys.stderr, flush=True)
        return 2
    except (KafkaError, OSError) as exc:
        # Broker unreachable, metrics port taken, ...: say what, without a traceback.
        print(f"worker: cannot start: {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
