"""Small vocabularies shared by the wire schemas and the pure core.

Plain ``Literal`` types and ordered tuples, so the core can use them without pulling in
pydantic models. The order of ``PRIORITIES`` is the order of service: index 0 goes first.
"""

from __future__ import annotations

from typing import Final, Literal

#: 2: ``Assignment.engine_priority`` (readers of 1 refuse it; 2 reads 1's messages).
#: 3: ``Assignment.worker_started_at`` (readers of 2 refuse it; 3 reads 1's and 2's).
#: 4: ``WorkerHeartbeat.renew`` and the ``lease`` control message (readers of 3 refuse both;
#: 4 reads 1's to 3's).
#: 5: prefill and decode apart: ``WorkerHeartbeat.role``, ``Assignment.phase`` and
#: ``kv_transfer``, the ``event.prefilled`` event (readers of 4 refuse them; 5 reads 1's to 4's).
SCHEMA_VERSION: Final = 5

Priority = Literal["high", "normal", "low"]
PRIORITIES: Final[tuple[Priority, ...]] = ("high", "normal", "low")

Lane = Literal["short", "long"]
LANES: Final[tuple[Lane, ...]] = ("short", "long")

Pool = Literal["short", "long", "any"]
POOLS: Final[tuple[Pool, ...]] = ("short", "long", "any")

#: What a worker's engine does with a request (prefill/decode disaggregation, as
#: Splitwise and vLLM's KV connectors do it): ``mixed`` runs requests whole (prompt and
#: output on one engine, the default); ``prefill`` computes prompts and hands their KV
#: cache on; ``decode`` takes hand-offs (and, when every prefill worker is loaded, long
#: requests whole).
Role = Literal["mixed", "prefill", "decode"]
ROLES: Final[tuple[Role, ...]] = ("mixed", "prefill", "decode")

#: Which part of a request a placement covers: ``whole`` (prompt and output on one
#: worker), ``prefill`` (the prompt, on a prefill worker; one token sampled and
#: discarded) or ``decode`` (the output, on a decode worker that received the prompt's KV).
Phase = Literal["whole", "prefill", "decode"]

#: Upper bound on max_tokens and on any token count a message reports (here, not in
#: schemas.base, so the pure cores can check it without importing pydantic).
MAX_TOKENS: Final = 1 << 20
#: The last attempt a request may have (wire: ``Attempt``); the scheduler ends a request
#: lost at it instead of requeueing it.
MAX_ATTEMPT: Final = 1_000

#: A topic prefix: dot-separated words of [A-Za-z0-9_-], the first starting alphanumeric
#: (``llmq``, ``team-a.llmq``); the settings and the topic catalog check the same rule.
TOPIC_PREFIX_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$"
TOPIC_PREFIX_MAX: Final = 64

ErrorCode = Literal[
    "rate_limited",
    "too_large",
    "unknown_model",
    "invalid",
    "queue_timeout",
    "timeout",
    "worker_lost",
    "cancelled",
    "overloaded",
]

#: HTTP status for each terminal error code (DESIGN.md, "Semantics").
HTTP_STATUS: Final[dict[ErrorCode, int]] = {
    "rate_limited": 429,
    "too_large": 413,
    "unknown_model": 404,
    "invalid": 400,
    "queue_timeout": 504,
    "timeout": 504,
    "worker_lost": 503,
    "cancelled": 499,
    "overloaded": 503,
}


def priority_rank(priority: Priority) -> int:
    """0 for high, 1 for normal, 2 for low: smaller is served first."""
    return PRIORITIES.index(priority)


def engine_rank(class_rank: int, lane: Lane, phase: Phase = "whole") -> int:
    """The request priority a worker gives an engine that schedules by priority (vLLM's
    ``--scheduling-policy priority``: lower first, ties by arrival): the class first
    (``class_rank`` 0 high … 2 low), then, within a class, the short lane before the long
    one — ``2 · class_rank + (1 if long)``, 0 … 5. So a short request that meets long
    prompts in one engine (borrowed workers, ``any`` pools) is not prefilled behind them.

    A prefill stage (``phase == "prefill"``) is ranked for a queue of prompts: the high
    class first (short, then long), then every short prompt before every long one, the
    class deciding within a lane — high short 0, high long 1, normal short 2, low short 3,
    normal long 4, low long 5. A short prompt costs a long one little (shortest first),
    and a prefill engine's queue holds the fleet's prompt backlog (its reservations are
    prompts only), where class first would keep low short requests behind every normal
    long prompt (docs/benchmarks.md, "Thirteenth round")."""
    long = 1 if lane == "long" else 0
    if phase == "prefill" and class_rank > 0:
        return 2 + 2 * long + (class_rank - 1)
    return 2 * class_rank + long
