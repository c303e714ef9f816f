"""Settings of the scheduler service (``LLMQ_SCHEDULER_*``, plus ``LLMQ_METRICS_PORT``).

Read once in ``services.scheduler.__main__`` (command-line flags override the environment)
and passed down frozen, next to the shared :class:`services.common.settings.Settings`.
:meth:`SchedulerSettings.queue_config` and :meth:`SchedulerSettings.profile` turn them into
the core's validated config values.
"""

from __future__ import annotations

import re
import socket
import tomllib
from collections.abc import Mapping
from pathlib import Path

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.scheduler import DEFAULT_PROFILE, QueueConfig

_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class SchedulerSettings(BaseSettings):
    """Each field maps to ``LLMQ_SCHEDULER_<NAME>``; the metrics port to ``LLMQ_METRICS_PORT``."""

    model_config = SettingsConfigDict(
        env_prefix="LLMQ_SCHEDULER_", frozen=True, extra="ignore", populate_by_name=True
    )

    app_name: str = Field(
        default="scheduler",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,40}$",
        description="Faust app name; the app id (consumer group) is <topic_prefix>-<name>.",
    )
    scheduler_id: str | None = Field(
        default=None,
        pattern=_NAME,
        description="This instance's id: worker_id of the events it sends, scheduler_id of "
        "its QueueStatus. Default scheduler-<host>, stable across restarts.",
    )
    max_pending: int = Field(
        default=100_000, ge=1, le=10_000_000,
        description="Bound of the pending queue; request topics pause as it fills.",
    )
    pause_band: float = Field(
        default=0.1, ge=0.0, lt=1.0,
        description="Request topics pause between (1 - band) and 100 % of max_pending, "
        "lowest priority (low.long) first, high.short last.",
    )
    resume_hysteresis: float = Field(
        default=0.05, gt=0.0, lt=1.0,
        description="A paused topic resumes once the queue is this fraction of max_pending "
        "below its pause threshold.",
    )
    replicas: int | None = Field(
        default=None, ge=1, le=64,
        description="How many scheduler replicas run (one consumer group shares the request "
        "topics). With more than one, each worker takes new work from one replica at a time, "
        "in turns (filter replica-turn), so replicas placing at the same moment do not "
        "overcommit its KV. Unset: read from the consumer group's live members (each "
        "replica's scheduler_id must be its own), and followed as replicas come and go.",
    )
    replica_index: int | None = Field(
        default=None, ge=0, le=63,
        description="With LLMQ_SCHEDULER_REPLICAS set: this replica's own number, in "
        "[0, replicas) (a StatefulSet ordinal); 0 if unset.",
    )
    turn_slot_s: float = Field(
        default=0.5, gt=0.0, le=60.0,
        description="With several replicas: length of a replica's turn on a worker.",
    )
    turn_guard_s: float = Field(
        default=0.05, gt=0.0, le=30.0,
        description="With several replicas: a worker is nobody's turn this long at each end "
        "of a turn, time for the last placements to be written and read back; below "
        "turn_slot_s / 2.",
    )
    max_held_per_partition: int = Field(
        default=2_000, ge=1, le=1_000_000,
        description="A request partition pauses while it holds this many records not yet "
        "committed (waiting, or done behind an older one still waiting: a blocked head "
        "keeps every record behind it in memory); it resumes resume_hysteresis of this "
        "below.",
    )
    aging_s_per_class: float = Field(
        default=30.0, gt=0.0, le=86_400.0,
        description="Seconds of waiting that raise a request by one priority class.",
    )
    handoff_step_s: float = Field(
        default=1.0, ge=0.0, le=3_600.0,
        description="Hand-offs waiting for a decode worker go oldest first, but this many "
        "seconds later per class below high: a high request's hand-off overtakes a normal "
        "one admitted up to this long before it (a low one, twice as long).",
    )
    short_weight: float = Field(
        default=3.0, gt=0.0, le=1000.0, description="Weight of the short lane on 'any' workers."
    )
    long_weight: float = Field(
        default=1.0, gt=0.0, le=1000.0, description="Weight of the long lane on 'any' workers."
    )
    kv_safety_margin: float = Field(
        default=0.05, ge=0.0, lt=1.0,
        description="Fraction of each worker's KV never promised (decode growth, fragmentation).",
    )
    profile_file: Path | None = Field(
        default=None, description="Placement profile (TOML); none: the core's DEFAULT_PROFILE."
    )
    heartbeat_staleness: float = Field(
        default=3.0, gt=0.0, le=100.0,
        description="A worker is dead once its heartbeat is this many of its own interval_s "
        "old (DESIGN.md: 3).",
    )
    handoff_ttl_s: float | None = Field(
        default=None, gt=0.0, le=86_400.0,
        description="Prefill and decode apart: how long the prefill workers' KV connector "
        "keeps an unread prompt's KV (vLLM NixlConnector: kv_lease_duration). A decode "
        "stage still queued that long after its hand-off starts over whole instead of "
        "failing on missing KV. Unset: as long as the prefill worker lives.",
    )
    default_block_size: int = Field(
        default=16, ge=1, le=1 << 16,
        description="KV block size used to round reservations when no live worker of the "
        "model reports one.",
    )
    dispatch_interval_s: float = Field(
        default=0.05, gt=0.0, le=10.0,
        description="Longest pause of the dispatch loop; arrivals and releases wake it sooner.",
    )
    max_placements_per_cycle: int = Field(
        default=512, ge=1, le=1_000_000,
        description="Placements per schedule() call: bounds one batch of sends.",
    )
    status_interval_s: float = Field(
        default=1.0, gt=0.0, le=60.0, description="Period of QueueStatus on llmq.status."
    )
    drain_window_s: float = Field(
        default=30.0, gt=0.0, le=3600.0,
        description="Sliding window of the measured drain rate (tokens finished per second).",
    )
    send_timeout_s: float = Field(
        default=10.0, gt=0.0, le=300.0,
        description="Wait this long for the broker to acknowledge one batch of sends; what is "
        "not acknowledged is sent again (its request stays unacked meanwhile).",
    )
    reply_give_up_s: float = Field(
        default=60.0, gt=0.0, le=3600.0,
        description="A terminal reply the scheduler sends to a client's reply topic is given "
        "up (logged, counted) after this long without getting through, or at once if the "
        "broker refuses it for good (the topic cannot be made, a record too large); its "
        "terminal event still goes. One tenant's reply topic never holds back the rest.",
    )
    takeover_s: float = Field(
        default=15.0, ge=0.0, le=3600.0,
        description="A replica that begins to lead (a rebalance, a start) decides worker "
        "losses and hand-offs, and grants lease renewals, only after leading this long, so "
        "that its log has what the previous leader sent last: keep it above "
        "send_timeout_s.",
    )
    catchup_timeout_s: float = Field(
        default=120.0, gt=0.0, le=3600.0,
        description="Start fails if heartbeats, assignments and events cannot be read up to "
        "their end within this long.",
    )
    cancel_memory_s: float = Field(
        default=86_400.0, ge=0.0, le=86_400.0,
        description="A cancel for a request not seen yet is remembered this long from its "
        "issued_at (at most 100,000 of them): by default as long as a request's timeout may "
        "be, a day, since its record may wait that long in Kafka behind paused topics.",
    )
    finished_memory_s: float = Field(
        default=3600.0, ge=0.0, le=7 * 86_400.0,
        description="A finished request is remembered this long past its deadline, so that a "
        "redelivered copy is skipped rather than answered twice.",
    )
    seed: int | None = Field(
        default=None, ge=0, description="Seed of the pickers' RNG; none: from the OS."
    )
    metrics_port: int | None = Field(
        default=None, ge=1, le=65535,
        validation_alias=AliasChoices("LLMQ_METRICS_PORT", "LLMQ_SCHEDULER_METRICS_PORT"),
        description="Prometheus metrics on 127.0.0.1:<port>; none: off.",
    )
    log_level: str = Field(default="info", pattern=r"^(debug|info|warning|error)$")

    @model_validator(mode="after")
    def _turns(self) -> SchedulerSettings:
        if self.replicas is None and self.replica_index is not None:
            raise ValueError("LLMQ_SCHEDULER_REPLICA_INDEX needs LLMQ_SCHEDULER_REPLICAS (unset "
                             "both to take them from the consumer group)")
        if self.replicas is not None and (self.replica_index or 0) >= self.replicas:
            raise ValueError(f"LLMQ_SCHEDULER_REPLICA_INDEX ({self.replica_index}) must be "
                             f"below LLMQ_SCHEDULER_REPLICAS ({self.replicas}): give each "
                             "replica its own number from 0")
        if 2 * self.turn_guard_s >= self.turn_slot_s:
            raise ValueError("LLMQ_SCHEDULER_TURN_GUARD_S must be below half of "
                             "LLMQ_SCHEDULER_TURN_SLOT_S")
        return self

    def resolved_scheduler_id(self) -> str:
        """``scheduler_id``, or ``scheduler-<host>`` made safe for an id."""
        if self.scheduler_id is not None:
            return self.scheduler_id
        host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0]) or "host"
        return f"scheduler-{host[:40].strip('-_') or 'host'}"

    def queue_config(self) -> QueueConfig:
        """The core's validated queue config."""
        return QueueConfig(
            aging_s_per_class=self.aging_s_per_class,
            max_pending=self.max_pending,
            lane_weights={"short": self.short_weight, "long": self.long_weight},
            handoff_step_s=self.handoff_step_s,
        )

    def static_turns(self) -> tuple[int, int] | None:
        """(replicas, this one's index) as set; None: from the consumer group."""
        if self.replicas is None:
            return None
        return self.replicas, self.replica_index or 0

    def profile(self, turns: tuple[int, int] | None = None) -> Mapping[str, object]:
        """The placement profile mapping (``build_pipeline`` validates it), with the
        ``replica-turn`` filter when several replicas run: ``turns`` (replicas, index), or
        else :meth:`static_turns`."""
        profile = (DEFAULT_PROFILE if self.profile_file is None
                   else read_profile_file(self.profile_file))
        turns = turns or self.static_turns()
        if turns is None or turns[0] == 1:
            return profile
        filters = profile.get("filters", DEFAULT_PROFILE["filters"])
        params = profile.get("params", {})
        if not isinstance(filters, list | tuple) or not isinstance(params, Mapping):
            return profile  # build_pipeline says what is wrong
        turn = {"replicas": turns[0], "index": turns[1],
                "slot_s": self.turn_slot_s, "guard_s": self.turn_guard_s}
        return {
            **profile,
            "filters": [*(f for f in filters if f != "replica-turn"), "replica-turn"],
            "params": {**params, "replica-turn": turn},
        }


def read_profile_file(path: Path) -> Mapping[str, object]:
    """A placement profile file (TOML) as the mapping ``build_pipeline`` validates: the
    scheduler's ``LLMQ_SCHEDULER_PROFILE_FILE``, and the simulator's ``llmq bench
    policies --scheduler-profile``. ``OSError`` if unreadable, ``ValueError`` (a
    ``tomllib.TOMLDecodeError``) if not TOML."""
    with path.open("rb") as handle:
        return tomllib.load(handle)
