"""Settings of one worker process (``LLMQ_WORKER_*``, plus ``LLMQ_METRICS_PORT``).

Read once in ``services.worker.__main__`` (command-line flags override the environment)
and passed down frozen, next to the shared :class:`services.common.settings.Settings`.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.base import ID_PATTERN, MODEL_PATTERN, NAME_PATTERN
from schemas.common import Pool, Role
from services.worker.engines.base import SchedulingPolicy

EngineKind = Literal["sim", "openai", "vllm"]


class WorkerSettings(BaseSettings):
    """Each field maps to ``LLMQ_WORKER_<NAME>``; the metrics port also to
    ``LLMQ_METRICS_PORT`` (shared by every service)."""

    model_config = SettingsConfigDict(
        env_prefix="LLMQ_WORKER_", frozen=True, extra="ignore", populate_by_name=True
    )

    slot: int = Field(ge=0, le=100_000, description="Partition of <prefix>.assignments owned.")
    pool: Pool = Field(default="any", description="Lanes taken: short, long or any.")
    role: Role = Field(
        default="mixed",
        description="What the worker runs: mixed (requests whole), prefill (prompts; their KV "
        "cache is handed to a decode worker) or decode (hand-offs, and long requests whole "
        "when every prefill worker is loaded). prefill and decode need an engine that runs "
        "them apart (sim, openai against vLLM with a KV connector); checked at startup.",
    )
    engine: EngineKind = Field(default="sim", description="Engine: sim, openai or vllm.")
    profile: str = Field(
        default="llama3-8b-h100",
        description="sim engine profile (services/worker/engines/sim/profiles.toml); the "
        "openai/vllm engines take KV bytes per token and fallback capacity from it.",
    )
    profile_file: Path | None = Field(
        default=None, description="Extra profiles TOML (its names win over shipped ones)."
    )
    model: str | None = Field(
        default=None, pattern=MODEL_PATTERN,
        description="Model name served and heartbeated; default: the profile's model.",
    )
    model_version: str | None = Field(default=None, pattern=NAME_PATTERN)
    worker_id: str | None = Field(
        default=None, pattern=ID_PATTERN,
        description="Stable worker id; default <host>-slot<N> (stable across restarts, so a "
        "restarted worker picks up its own unfinished assignments).",
    )
    openai_url: str | None = Field(
        default=None, description="Base URL of the OpenAI-compatible server (openai engine)."
    )
    openai_model: str | None = Field(
        default=None, description="Model name the server serves; default: model."
    )
    openai_api_key: str | None = Field(default=None, description="Bearer token, if needed.")
    vllm_args: dict[str, Any] = Field(
        default_factory=dict, description="Extra AsyncEngineArgs for the vllm engine (JSON)."
    )
    scheduling_policy: SchedulingPolicy | None = Field(
        default=None,
        description="How the engine orders requests it has not started: priority = by the "
        "request's class, then arrival (vLLM's --scheduling-policy priority), fcfs = arrival "
        "only. Default: priority for the sim and vllm engines (the vllm engine is started "
        "with it); fcfs for openai, which sends the class as vLLM's `priority` field only "
        "when set to priority (start that server with --scheduling-policy priority).",
    )
    heartbeat_interval_s: float = Field(default=1.0, gt=0, le=60)
    lease_beats: float = Field(
        default=2.75, ge=1.5, lt=3.0,
        description="Answer work only while the newest acknowledged heartbeat is younger "
        "than this many intervals; past it the process fences itself (services.worker.core."
        "lease). Under the scheduler's heartbeat_staleness (3, DESIGN.md), so that the lease "
        "lapses before the scheduler can declare this worker dead and give its work away.",
    )
    lease_ask_beats: float = Field(
        default=2.0, ge=0.0, le=100.0,
        description="Once the lease lapses, hold every run's records and ask the scheduler "
        "(heartbeats with renew) for up to this many intervals whether the work is still "
        "ours; fence if it says no or does not answer. 0: fence at once, without asking.",
    )
    chunk_tokens: int = Field(default=16, ge=1, le=4096, description="Flush a chunk at N tokens.")
    chunk_ms: float = Field(default=50.0, ge=0, le=10_000, description="... or after M ms.")
    time_scale: float = Field(
        default=1.0, ge=0, le=1000,
        description="sim engine: real seconds per simulated second (0.01 = 100x faster).",
    )
    seed: int = Field(default=0, ge=0, description="sim engine: seed of the simulated text.")
    max_in_flight: int | None = Field(
        default=None, ge=1, le=1 << 20,
        description="Requests handed to the engine at once; default: its max_num_seqs.",
    )
    dedupe_capacity: int = Field(default=100_000, ge=1, le=10_000_000)
    cancel_memory_s: float = Field(default=60.0, gt=0, le=86_400)
    send_timeout_s: float = Field(
        default=30.0, gt=0, le=600, description="Longest wait for the broker to ack a send."
    )
    drain_quiet_s: float | None = Field(
        default=None, ge=0, le=600,
        description="Draining: exit once idle and no assignment arrived for this long "
        "(default 2 heartbeat intervals, so the scheduler saw the draining heartbeat).",
    )
    handoff_hold_s: float = Field(
        default=120.0, ge=0, le=3600,
        description="Prefill role, draining: before exiting, wait for each hand-off's decode "
        "stage to take the prompt's KV (its first token), but no longer than this after the "
        "hand-off or past the request's deadline. No shorter than the connector keeps an "
        "unread prompt's KV (vLLM NixlConnector: kv_lease_duration; older versions "
        "VLLM_NIXL_ABORT_REQUEST_TIMEOUT). 0: exit without waiting.",
    )
    session_timeout_ms: int = Field(
        default=10_000, ge=6_000, le=300_000,
        description="Slot group session timeout: how long a dead worker holds its slot. At "
        "least Kafka's group.min.session.timeout.ms (6000 by default, also on the dev "
        "broker), which refuses a shorter one when the worker joins; longer than the lease.",
    )
    nvml: Literal["auto", "off"] = Field(
        default="auto", description="auto: read VRAM/utilisation from NVML when a GPU is "
        "present (not for the sim engine, whose GPU is simulated).",
    )
    gpu_index: int = Field(default=0, ge=0, le=64, description="NVML device index.")
    metrics_port: int | None = Field(
        default=None, ge=1, le=65535,
        validation_alias=AliasChoices("LLMQ_METRICS_PORT", "LLMQ_WORKER_METRICS_PORT",
                                      "metrics_port"),
        description="Serve Prometheus metrics on 127.0.0.1:<port> when set.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @model_validator(mode="after")
    def _lease_ends_before_the_slot(self) -> WorkerSettings:
        # A process dropped from its slot group (paused or cut off past the session
        # timeout) must have lost its lease already: the slot's rules (services.worker.slot)
        # and on_assigned end its work unanswered on that assumption.
        lease_s, session_s = self.lease_s(), self.session_timeout_ms / 1000
        if lease_s >= session_s:
            raise ValueError(
                f"the lease (lease_beats × heartbeat_interval_s = {self.lease_beats:g} × "
                f"{self.heartbeat_interval_s:g} s = {lease_s:g} s) must be shorter than the "
                f"slot group's session timeout (session_timeout_ms = "
                f"{self.session_timeout_ms} ms): lower heartbeat_interval_s or lease_beats, "
                f"or raise session_timeout_ms above {lease_s * 1000:.0f}")
        return self

    def resolved_worker_id(self) -> str:
        """``worker_id``, or ``<host>-slot<N>`` made safe for an id."""
        if self.worker_id is not None:
            return self.worker_id
        host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname().split(".")[0])
        host = host.strip("-_.")[:100] or "host"
        return f"{host}-slot{self.slot}"

    def lease_s(self) -> float:
        """How long one acknowledged heartbeat lets this worker answer its work."""
        return self.lease_beats * self.heartbeat_interval_s

    def lease_ask_s(self) -> float:
        """How long a lapsed lease waits for the scheduler's answer before fencing."""
        return self.lease_ask_beats * self.heartbeat_interval_s

    def resolved_drain_quiet_s(self) -> float:
        if self.drain_quiet_s is not None:
            return self.drain_quiet_s
        return 2 * self.heartbeat_interval_s
