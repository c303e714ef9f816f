"""Admission: admit a request into the queue, or reject it with a code and a Retry-After.

``admit()`` is a pure function over the request, the tenant's policy and bucket state, and a
frozen :class:`ClusterView`; it returns :class:`Admit` or :class:`Reject` (decisions are
data; the ingest agent publishes them). Checks, first failure wins:

1. ``invalid`` (400): malformed numbers (max_tokens < 1, prompt_tokens < 0, timeout ≤ 0).
2. ``unknown_model`` (404): the model is neither in the registry nor in the view (served
   by a live worker, or by one seen lately: ``services.ingest.cluster``; such a model
   without a live worker is ``overloaded`` below, which clients retry). A model the
   tenant may not use gets the same code and the same message, so a tenant cannot probe
   which models exist (as OpenAI answers "does not exist or you do not have access");
   ``Reject.check`` tells the two apart in logs and metrics.
3. ``too_large`` (413): ``prompt + max_tokens > max_model_len`` (the registry's, or the
   view's when it has a smaller one), or the KV reservation ``kv_tokens_for(prompt,
   max_tokens, block_size)`` (the live workers' block size, else the registry's) exceeds
   the usable KV of the largest live worker for the model, or the request needs
   more tokens than the tenant's token bucket can ever hold (retrying would never help).
4. ``rate_limited`` (429): concurrency cap (Retry-After ``CONCURRENCY_RETRY_AFTER_S``, 1 s:
   when a slot frees is unknown, so the client polls), request or token bucket (exact
   Retry-After, see :mod:`.rate_limit`, at most ``RETRY_AFTER_CEILING_S``, an hour).
5. ``overloaded`` (503), fail closed: no live worker for the model (empty fleet =
   saturated); or a non-empty queue that the fleet could not start at once
   (``queued + need > kv_headroom_tokens``) and that, with no measured drain rate, gets
   Retry-After ``unknown_drain_retry_after_s`` (the reason says so), or that would not
   drain in time: ``queued + need > drain × timeout_s``, Retry-After =
   ``min(queued, queued + need − drain × timeout_s) / drain`` (the time until, with no new
   arrivals, the backlog fits or is gone), capped at ``max_retry_after_s``. An empty queue
   never rejects: the request starts at once and its own length is bounded by 3.

A rejected request consumes nothing: ``Reject`` carries no state, the caller keeps the old
one. A requested priority above the tenant's ``max_priority`` is lowered, not rejected.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from schemas.common import MAX_TOKENS, PRIORITIES, ErrorCode, Lane, Priority, priority_rank
from services.ingest.core.classify import classify_lane
from services.ingest.core.config import RETRY_AFTER_CEILING_S, AdmissionConfig
from services.ingest.core.models import ModelShape
from services.ingest.core.rate_limit import TenantPolicy, TenantState, try_consume
from services.ingest.core.tokens import kv_tokens_for

RejectCheck = Literal[
    "invalid_request", "unknown_model", "model_not_allowed", "max_model_len", "kv_capacity",
    "tenant_burst", "concurrency", "requests", "tokens", "no_live_workers", "drain_unknown",
    "queue_backlog",
]


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """What admission needs to know about one request (built by the adapter from the wire
    message; ``prompt_tokens`` already counted by :mod:`.tokens`)."""

    request_id: str
    tenant: str
    model: str
    prompt_tokens: int
    max_tokens: int
    priority: Priority
    lane_hint: Lane | None
    timeout_s: float


@dataclass(frozen=True, slots=True)
class ModelCapacity:
    """The fleet's capacity for one model, from fresh heartbeats and the scheduler's queue.

    ``live_workers``: workers with a fresh heartbeat that reported their KV budget, serving
    the model (stale or unprofiled ones are not counted: fail closed).
    ``max_usable_kv_tokens``: usable KV token slots of the largest such worker (its whole
    budget, not what is free now). ``queued_tokens``: Σ (prompt +
    max_tokens) of admitted requests for the model not yet placed. ``drain_tokens_per_s``:
    the same unit leaving the queue per second, measured while work waited (0 or NaN:
    unknown — a fleet that has not been busy yet has no measured capacity).
    ``max_model_len``: a context limit of the fleet's, when one is known (the live
    tracker has none: heartbeats do not carry it, so ingest checks the registry's and an
    engine serving a shorter context refuses the rest ``too_large`` itself).
    ``block_size``: the live workers' KV block size (the largest), None if unknown.
    ``kv_headroom_tokens``: Σ KV budget of the live workers minus what running requests
    reserve — how much could start at once. A backlog within it is admitted whatever the
    drain rate (an idle fleet's measured rate says little about what it can do).
    """

    model: str
    live_workers: int
    max_usable_kv_tokens: int
    queued_tokens: int
    drain_tokens_per_s: float
    max_model_len: int | None = None
    kv_headroom_tokens: int = 0
    block_size: int | None = None


@dataclass(frozen=True, slots=True)
class ClusterView:
    """Snapshot of the fleet, per model, keyed by canonical model name (the registry's name
    when the model is known, else the name the workers serve it under)."""

    models: Mapping[str, ModelCapacity] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, capacities: Iterable[ModelCapacity]) -> ClusterView:
        """A view keyed by each capacity's ``model``."""
        return cls(MappingProxyType({c.model: c for c in capacities}))


@dataclass(frozen=True, slots=True)
class Admit:
    """Admitted: publish to ``llmq.requests.<priority>.<lane>`` and store ``new_state``.

    ``reserved_tokens`` (prompt + max_tokens) is what was taken from the token bucket: keep
    it per request_id and pass it to :func:`~.rate_limit.settle` at the terminal event.
    ``lowered_from`` is the requested priority when it was above the tenant's maximum.
    """

    model: str
    lane: Lane
    priority: Priority
    prompt_tokens: int
    kv_tokens: int
    reserved_tokens: int
    new_state: TenantState
    lowered_from: Priority | None = None


@dataclass(frozen=True, slots=True)
class Reject:
    """Rejected: answer with ``code`` (HTTP status from ``schemas.common.HTTP_STATUS``),
    ``reason`` for the client, ``retry_after_s`` for the Retry-After header (None: omit).
    ``check`` names the failed check for logs and metrics; it is not sent to the client."""

    code: ErrorCode
    reason: str
    retry_after_s: float | None
    check: RejectCheck


AdmitResult = Admit | Reject


def admit(
    request: AdmissionRequest,
    tenant_policy: TenantPolicy,
    tenant_state: TenantState,
    cluster_view: ClusterView,
    now: float,
    *,
    config: AdmissionConfig,
) -> AdmitResult:
    """Decide one request (checks and formulas in the module docstring)."""
    if request.tenant != tenant_policy.tenant:
        raise ValueError(f"policy of {tenant_policy.tenant!r} passed for {request.tenant!r}")
    invalid = _invalid(request)
    if invalid is not None:
        return invalid
    shape = config.registry.get(request.model)
    model = request.model if shape is None else shape.name
    capacity = cluster_view.models.get(model) or cluster_view.models.get(request.model)
    live = capacity is not None and capacity.live_workers > 0
    if shape is None and capacity is None:
        return _unknown_model(request.model, "unknown_model")
    if not may_use_model(tenant_policy, request.model, shape):
        return _unknown_model(request.model, "model_not_allowed")
    total = request.prompt_tokens + request.max_tokens
    # Rounded as the scheduler will round it: to the live workers' block size.
    live_block = capacity.block_size if capacity is not None and live else None
    block_size = live_block or (config.default_block_size if shape is None
                                else shape.block_size)
    kv_tokens = kv_tokens_for(request.prompt_tokens, request.max_tokens, block_size)
    too_large = _too_large(
        request.prompt_tokens, total, kv_tokens, shape, capacity if live else None
    )
    if too_large is not None:
        return too_large
    new_state, throttle = try_consume(tenant_state, tenant_policy, total, now)
    if throttle is not None:
        code: ErrorCode = "too_large" if throttle.limit == "burst" else "rate_limited"
        check: RejectCheck = "tenant_burst" if throttle.limit == "burst" else throttle.limit
        # The bucket's wait is exact, but past the ceiling (an hour) the number means
        # nothing to a client; one that retries sooner is refused again with the rest.
        retry = throttle.retry_after_s
        return Reject(code, throttle.reason,
                      None if retry is None else min(retry, RETRY_AFTER_CEILING_S), check)
    overloaded = _overloaded(model, total, request.timeout_s, capacity, config)
    if overloaded is not None:
        return overloaded
    return _admit(request, tenant_policy, model, total, kv_tokens, new_state, config)


def fitted_max_tokens(default: int, prompt_tokens: int, shape: ModelShape | None) -> int:
    """``max_tokens`` for a request that set none: ``default``, or the rest of the model's
    context (the registry's ``max_model_len``) when that is less — vLLM's own rule for an
    unset ``max_tokens``, so that a long prompt is not refused ``too_large`` for a limit the
    client never asked for. ``default`` when the model is not in the registry or the
    prompt alone fills the context (admission then refuses it, as it must)."""
    if shape is None:
        return default
    room = shape.max_model_len - prompt_tokens
    return min(default, room) if room >= 1 else default


def _invalid(request: AdmissionRequest) -> Reject | None:
    problem = None
    if request.max_tokens < 1:
        problem = f"max_tokens must be >= 1, got {request.max_tokens}"
    elif request.prompt_tokens < 0:
        problem = f"prompt_tokens must be >= 0, got {request.prompt_tokens}"
    elif not (0.0 < request.timeout_s < math.inf):
        problem = f"timeout_s must be a positive number, got {request.timeout_s}"
    elif request.priority not in PRIORITIES:
        problem = f"priority must be one of {', '.join(PRIORITIES)}, got {request.priority!r}"
    elif request.lane_hint not in (None, "short", "long"):
        problem = f"lane must be short or long, got {request.lane_hint!r}"
    return None if problem is None else Reject("invalid", problem, None, "invalid_request")


def _unknown_model(name: str, check: RejectCheck) -> Reject:
    reason = f"model {name!r} does not exist or this tenant may not use it"
    return Reject("unknown_model", reason, None, check)


def may_use_model(policy: TenantPolicy, name: str, shape: ModelShape | None) -> bool:
    """Whether the tenant may use model ``name`` (one of its registry names counts)."""
    allowed = policy.allowed_models
    if allowed is None or name in allowed:
        return True
    return shape is not None and not allowed.isdisjoint(shape.names)


def _too_large(
    prompt_tokens: int, total: int, kv_tokens: int, shape: ModelShape | None,
    capacity: ModelCapacity | None,
) -> Reject | None:
    if prompt_tokens > MAX_TOKENS:  # the wire's bound on any token count (schemas.base)
        reason = f"the prompt counts {prompt_tokens} tokens, more than {MAX_TOKENS} allowed"
        return Reject("too_large", reason, None, "max_model_len")
    limit = _context_limit(shape, capacity)
    if limit is not None and total > limit:
        reason = f"prompt + max_tokens = {total} exceeds the model's context of {limit}"
        return Reject("too_large", reason, None, "max_model_len")
    if capacity is not None and kv_tokens > capacity.max_usable_kv_tokens:
        reason = (
            f"request needs {kv_tokens} KV token slots; the largest live worker has "
            f"{capacity.max_usable_kv_tokens}"
        )
        return Reject("too_large", reason, None, "kv_capacity")
    return None


def _context_limit(shape: ModelShape | None, capacity: ModelCapacity | None) -> int | None:
    limits = [shape.max_model_len] if shape is not None else []
    if capacity is not None and capacity.max_model_len is not None:
        limits.append(capacity.max_model_len)
    return min(limits) if limits else None


def _overloaded(
    model: str, need: int, timeout_s: float, capacity: ModelCapacity | None,
    config: AdmissionConfig,
) -> Reject | None:
    if capacity is None or capacity.live_workers <= 0:
        reason = f"no live worker serves {model!r} (fail closed)"
        return Reject("overloaded", reason, config.unknown_drain_retry_after_s, "no_live_workers")
    queued = capacity.queued_tokens
    if queued <= 0 or queued + need <= capacity.kv_headroom_tokens:
        return None  # all of it can start now, whatever the drain rate says
    drain = capacity.drain_tokens_per_s
    if not drain > 0.0:  # also NaN
        reason = (
            f"{queued} tokens queued for {model!r}, more than the fleet's free KV "
            f"({capacity.kv_headroom_tokens}), and no measured drain rate yet; failing closed"
        )
        return Reject("overloaded", reason, config.unknown_drain_retry_after_s, "drain_unknown")
    drainable = drain * timeout_s
    if queued + need <= drainable:
        return None
    retry = min(queued, queued + need - drainable) / drain
    reason = (
        f"{queued} tokens queued for {model!r} drain at {drain:.0f} tokens/s: "
        f"not within this request's {timeout_s:g} s timeout"
    )
    return Reject("overloaded", reason, min(retry, config.max_retry_after_s), "queue_backlog")


def _admit(
    request: AdmissionRequest, policy: TenantPolicy, model: str, total: int, kv_tokens: int,
    new_state: TenantState, config: AdmissionConfig,
) -> Admit:
    lowered = priority_rank(request.priority) < priority_rank(policy.max_priority)
    lane = classify_lane(total, model, request.lane_hint, policy.may_set_lane, config.lanes)
    return Admit(
        model=model,
        lane=lane,
        priority=policy.max_priority if lowered else request.priority,
        prompt_tokens=request.prompt_tokens,
        kv_tokens=kv_tokens,
        reserved_tokens=total,
        new_state=new_state,
        lowered_from=request.priority if lowered else None,
    )
