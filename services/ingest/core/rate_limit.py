"""Per-tenant rate limits: token buckets for requests/min and tokens/min, concurrency caps.

Buckets refill continuously: ``level(t) = min(capacity, level(t0) + rate × (t − t0))`` with
``rate = rpm / 60`` (or ``tpm / 60``) per second; capacity defaults to one minute's worth.
A request takes 1 from the request bucket and ``prompt + max_tokens`` from the token bucket
up front; :func:`settle` corrects the token bucket by actual usage when it ends and
releases its concurrency slot. The request bucket stays in ``[0, capacity]``; the token
bucket may go below zero, down to ``−capacity``, when a request used more than it reserved
(the prompt estimate was low): that debt is paid by refill before the next admission, so
over any window ``[t, t + W]`` a tenant is admitted at most ``capacity + rate × W`` of each
resource (the property tests check it) and uses at most that plus one capacity of tokens,
however its prompts fool the estimate.

Retry-After is exact: the time until both buckets hold what the request needs,
``max((need − level) / rate)`` over the two buckets. A bucket counts as holding ``need``
when it is within one microsecond of refill (``RESOLUTION_S``) of it, so a client that
retries at ``now + retry_after`` passes despite float rounding of epoch-sized clocks.

State is a plain frozen :class:`TenantState` (``to_dict``/``from_dict`` for a Faust table);
the ingest agent owns one per tenant and is its only writer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from schemas.common import Priority
from services.ingest.core import _settings as s
from services.ingest.core.errors import ConfigError

#: Clock resolution of the buckets: refill shortfalls smaller than this much time are ignored.
RESOLUTION_S: Final = 1e-6
#: Retry-After of a concurrency-cap refusal. When a slot frees is unknown (at the end of
#: one of the tenant's requests in flight), so this is a polling interval, not a promise:
#: one second, the shortest Retry-After a header can say.
CONCURRENCY_RETRY_AFTER_S: Final = 1.0
#: How far ahead of ``now`` a bucket's stamp may be and still count as clock skew between
#: agents (refill waits for the stamp). Further ahead, a clock that was wrong wrote it (or
#: ours stepped back): taken as stamped now, so the tenant is not locked out until then.
MAX_CLOCK_SKEW_S: Final = 5.0

ThrottleLimit = Literal["burst", "concurrency", "requests", "tokens"]


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """What one tenant may do. Built from ``tenants.<name>`` config by :meth:`from_mapping`.

    ``request_burst`` / ``token_burst`` are the bucket capacities (None: one minute's worth,
    ``rpm`` / ``tpm``). ``allowed_models`` None means every model. ``max_priority`` caps the
    priority a request may ask for (higher asks are lowered, not refused). ``may_set_lane``
    lets the tenant's lane hint override the token-count classification.
    """

    tenant: str
    rpm: float
    tpm: float
    max_concurrency: int
    request_burst: float | None = None
    token_burst: float | None = None
    allowed_models: frozenset[str] | None = None
    max_priority: Priority = "normal"
    may_set_lane: bool = False

    def __post_init__(self) -> None:
        where = f"tenants.{self.tenant}"
        s.positive_float(self.rpm, f"{where}.rpm")
        s.positive_float(self.tpm, f"{where}.tpm")
        s.positive_int(self.max_concurrency, f"{where}.max_concurrency")
        if self.request_burst is not None and s.positive_float(
            self.request_burst, f"{where}.request_burst"
        ) < 1.0:
            raise ConfigError(f"{where}.request_burst", "must be >= 1 or no request ever passes")
        if self.request_burst is None and self.rpm < 1.0:
            raise ConfigError(f"{where}.rpm", f"{self.rpm} < 1 makes a request bucket that "
                              "never holds one request: set request_burst = 1 (or more)")
        if self.token_burst is not None:
            s.positive_float(self.token_burst, f"{where}.token_burst")
        s.priority(self.max_priority, f"{where}.max_priority")

    @property
    def request_capacity(self) -> float:
        """Request bucket size: ``request_burst`` or ``rpm``."""
        return self.rpm if self.request_burst is None else self.request_burst

    @property
    def token_capacity(self) -> float:
        """Token bucket size: ``token_burst`` or ``tpm``."""
        return self.tpm if self.token_burst is None else self.token_burst

    @classmethod
    def from_mapping(cls, tenant: str, mapping: object) -> TenantPolicy:
        """Validate one ``tenants.<tenant>`` table; ``rpm``, ``tpm``, ``max_concurrency``
        are required, unknown keys are refused."""
        where = f"tenants.{tenant}"
        table = s.section(mapping, where)
        s.known_keys(table, _POLICY_KEYS, where)
        allowed = table.get("allowed_models")
        return cls(
            tenant=tenant,
            rpm=s.positive_float(s.required(table, "rpm", where), f"{where}.rpm"),
            tpm=s.positive_float(s.required(table, "tpm", where), f"{where}.tpm"),
            max_concurrency=s.positive_int(
                s.required(table, "max_concurrency", where), f"{where}.max_concurrency"
            ),
            request_burst=_optional_float(table, "request_burst", where),
            token_burst=_optional_float(table, "token_burst", where),
            allowed_models=(
                None if allowed is None
                else frozenset(s.strings(allowed, f"{where}.allowed_models"))
            ),
            max_priority=s.priority(table.get("max_priority", "normal"), f"{where}.max_priority"),
            may_set_lane=s.boolean(table.get("may_set_lane", False), f"{where}.may_set_lane"),
        )


_POLICY_KEYS: Final = (
    "rpm", "tpm", "max_concurrency", "request_burst", "token_burst",
    "allowed_models", "max_priority", "may_set_lane",
)


def _optional_float(table: Mapping[str, object], key: str, where: str) -> float | None:
    value = table.get(key)
    return None if value is None else s.positive_float(value, f"{where}.{key}")


def policies_from_mapping(mapping: object) -> dict[str, TenantPolicy]:
    """Every ``tenants.<name>`` table, validated."""
    table = s.section(mapping, "tenants")
    return {name: TenantPolicy.from_mapping(name, entry) for name, entry in table.items()}


@dataclass(frozen=True, slots=True)
class TenantState:
    """Bucket levels at ``updated_at`` and the number of requests in flight."""

    requests: float
    tokens: float
    updated_at: float
    in_flight: int = 0

    @classmethod
    def full(cls, policy: TenantPolicy, now: float) -> TenantState:
        """A tenant seen for the first time: both buckets full, nothing in flight."""
        return cls(policy.request_capacity, policy.token_capacity, now, 0)

    def to_dict(self) -> dict[str, float | int]:
        """Plain numbers, for a Faust table or JSON."""
        return {
            "requests": self.requests,
            "tokens": self.tokens,
            "updated_at": self.updated_at,
            "in_flight": self.in_flight,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> TenantState:
        """Inverse of :meth:`to_dict`; ValueError on a missing or non-numeric field."""
        in_flight = data.get("in_flight")
        if isinstance(in_flight, bool) or not isinstance(in_flight, int):
            raise ValueError(f"tenant state: in_flight must be an int, got {in_flight!r}")
        return cls(
            _number(data, "requests"), _number(data, "tokens"), _number(data, "updated_at"),
            in_flight,
        )


def _number(data: Mapping[str, object], key: str) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"tenant state: {key} must be a number, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class Throttle:
    """Why a request may not consume now.

    ``limit`` is ``burst`` (needs more tokens than the bucket can ever hold: retrying never
    helps, ``retry_after_s`` is None), ``concurrency`` (too many in flight: the release time
    is unknown, ``retry_after_s`` is :data:`CONCURRENCY_RETRY_AFTER_S`), or
    ``requests``/``tokens`` (the bucket that refills last; ``retry_after_s`` is exact).
    """

    limit: ThrottleLimit
    retry_after_s: float | None
    reason: str


def refilled(state: TenantState, policy: TenantPolicy, now: float) -> TenantState:
    """The state advanced to ``now``. A clock that went backwards refills nothing (past
    :data:`MAX_CLOCK_SKEW_S`, the state is re-stamped ``now``)."""
    if now <= state.updated_at:
        if state.updated_at - now > MAX_CLOCK_SKEW_S:
            return TenantState(state.requests, state.tokens, now, state.in_flight)
        return state
    requests, tokens, stamp = _levels(state, policy, now, policy.rpm / 60.0, policy.tpm / 60.0)
    return TenantState(requests, tokens, stamp, state.in_flight)


def try_consume(
    state: TenantState, policy: TenantPolicy, tokens: int, now: float
) -> tuple[TenantState, Throttle | None]:
    """Take one request and ``tokens`` tokens, and one concurrency slot.

    Returns ``(new_state, None)`` when admitted, else ``(state, Throttle)`` with the input
    state unchanged (a refusal costs nothing). Checks in order: burst (``tokens`` above the
    token capacity), concurrency, then both buckets.
    """
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if tokens > policy.token_capacity:
        return state, Throttle(
            "burst", None,
            f"request needs {tokens} tokens, more than tenant {policy.tenant!r} may ever "
            f"burst ({policy.token_capacity:g}); lower max_tokens or the prompt",
        )
    if state.in_flight >= policy.max_concurrency:
        return state, Throttle(
            "concurrency", CONCURRENCY_RETRY_AFTER_S,
            f"tenant {policy.tenant!r} has {state.in_flight} requests in flight "
            f"(max {policy.max_concurrency})",
        )
    request_rate, token_rate = policy.rpm / 60.0, policy.tpm / 60.0
    requests, tokens_level, stamp = _levels(state, policy, now, request_rate, token_rate)
    wait_requests = _wait(1.0, requests, request_rate)
    wait_tokens = _wait(float(tokens), tokens_level, token_rate)
    if wait_requests > 0.0 or wait_tokens > 0.0:
        return state, _bucket_throttle(policy, stamp, now, wait_requests, wait_tokens)
    return TenantState(
        max(0.0, requests - 1.0), max(0.0, tokens_level - tokens), stamp, state.in_flight + 1
    ), None


def _levels(
    state: TenantState, policy: TenantPolicy, now: float, request_rate: float, token_rate: float
) -> tuple[float, float, float]:
    """``refilled()`` without building a state (this is the hot path of admission)."""
    elapsed = now - state.updated_at
    if elapsed <= 0.0:
        stamp = state.updated_at if -elapsed <= MAX_CLOCK_SKEW_S else now
        return state.requests, state.tokens, stamp
    return (
        min(policy.request_capacity, state.requests + elapsed * request_rate),
        min(policy.token_capacity, state.tokens + elapsed * token_rate),
        now,
    )


def _wait(need: float, level: float, rate: float) -> float:
    """Seconds of refill until ``level`` reaches ``need``; 0 when within RESOLUTION_S."""
    shortfall = need - level
    if shortfall <= rate * RESOLUTION_S:
        return 0.0
    return shortfall / rate


def _bucket_throttle(
    policy: TenantPolicy, stamp: float, now: float, wait_r: float, wait_t: float
) -> Throttle:
    # A state stamped after `now` (clock skew between agents) starts refilling only then.
    lag = max(0.0, stamp - now)
    if wait_t >= wait_r:
        return Throttle("tokens", lag + wait_t,
                        f"tenant {policy.tenant!r} is over its token rate ({policy.tpm:g}/min)")
    return Throttle("requests", lag + wait_r,
                    f"tenant {policy.tenant!r} is over its request rate ({policy.rpm:g}/min)")


def settle(
    state: TenantState, policy: TenantPolicy, reserved_tokens: int, used_tokens: int, now: float
) -> TenantState:
    """Correct the token bucket by actual usage and release the concurrency slot.

    ``tokens = clamp(level + reserved − used, −capacity, capacity)``: unused tokens are
    refunded (never above capacity); usage above the reservation (the prompt estimate was
    low: ``ceil(bytes / 4)`` counts 2 tokens for ``"a1a1"``, which Llama-3 splits into 4)
    is charged, into debt down to ``−capacity``. Stopping at an empty bucket let a tenant
    whose prompts the estimate undercounts use several times its tokens per minute.
    ``in_flight`` drops by one, never below zero.

    Call it once per request, at its terminal event. It is not idempotent: a duplicate
    would refund and release twice (still bounded by capacity and zero). Delivery is
    at-least-once, so the caller dedupes: it keeps ``reserved_tokens`` per ``request_id``
    (the same table that supplies the argument) and settles only when it pops an entry.
    """
    current = refilled(state, policy, now)
    level = current.tokens + reserved_tokens - used_tokens
    return TenantState(
        current.requests,
        min(policy.token_capacity, max(-policy.token_capacity, level)),
        current.updated_at,
        max(0, current.in_flight - 1),
    )
