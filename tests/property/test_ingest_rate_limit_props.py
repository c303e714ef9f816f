"""Invariants of the token buckets (services.ingest.core.rate_limit), for random traffic.

(f) Over any window [t, t + W] a tenant is admitted at most ``capacity + rate × W`` tokens
and ``request_capacity + request_rate × W`` requests. It suffices to check windows that
start and end at admission times: any other window holds no more admissions than the
tightest such window inside it, and is at least as long.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from services.ingest.core import TenantPolicy, TenantState, settle, try_consume
from services.ingest.core.rate_limit import RESOLUTION_S

SETTINGS = settings(max_examples=300, deadline=None)


@st.composite
def policies(draw: st.DrawFn) -> TenantPolicy:
    rpm = draw(st.floats(1.0, 10_000.0))
    tpm = draw(st.floats(600.0, 10_000_000.0))
    return TenantPolicy(
        tenant="acme",
        rpm=rpm,
        tpm=tpm,
        max_concurrency=draw(st.integers(1, 16)),
        request_burst=draw(st.none() | st.floats(1.0, 10.0 * rpm)),
        token_burst=draw(st.none() | st.floats(1.0, 10.0 * tpm)),
    )


@dataclass(frozen=True)
class Step:
    """One arrival, sized relative to the policy so that traces saturate the buckets."""

    dt_share: float  # time since the previous arrival, as a share of the token fill time
    token_share: float  # tokens asked, as a share of the token capacity (> 1: burst refusal)
    used_fraction: float  # the settled request used this share of its reservation
    settle_oldest: bool

    def dt(self, policy: TenantPolicy) -> float:
        return self.dt_share * policy.token_capacity / (policy.tpm / 60.0)

    def tokens(self, policy: TenantPolicy) -> int:
        return int(self.token_share * policy.token_capacity)


steps = st.builds(
    Step,
    dt_share=st.floats(0.0, 0.5) | st.just(0.0),
    token_share=st.floats(0.0, 0.5) | st.floats(0.0, 1.2),
    used_fraction=st.floats(0.0, 1.5),
    settle_oldest=st.booleans(),
)


def _tolerance(count: int, rate_per_s: float, capacity: float) -> float:
    """Admissions may each be short by one RESOLUTION_S of refill, plus float noise."""
    return count * rate_per_s * RESOLUTION_S * 1.01 + 1e-9 * capacity + 1e-9


def _check_windows(admitted: list[tuple[float, float]], capacity: float, rate: float) -> None:
    for i, (start, _) in enumerate(admitted):
        total = 0.0
        for count, (end, amount) in enumerate(admitted[i:], start=1):
            total += amount
            bound = capacity + rate * (end - start)
            assert total <= bound + _tolerance(count, rate, capacity), (start, end, total, bound)


@SETTINGS
@given(
    policy=policies(),
    start=st.floats(0.0, 2e9),
    trace=st.lists(steps, max_size=60),
)
def test_admitted_tokens_and_requests_never_exceed_the_bucket_over_any_window(
    policy: TenantPolicy, start: float, trace: list[Step]
) -> None:
    now, state = start, TenantState.full(policy, start)
    tokens_admitted: list[tuple[float, float]] = []
    requests_admitted: list[tuple[float, float]] = []
    in_flight: list[int] = []
    for step in trace:
        now += step.dt(policy)
        if step.settle_oldest and in_flight:
            reserved = in_flight.pop(0)  # used == reserved: nothing refunded
            state = settle(state, policy, reserved, reserved, now)
        tokens = step.tokens(policy)
        state, throttle = try_consume(state, policy, tokens, now)
        if throttle is None:
            in_flight.append(tokens)
            tokens_admitted.append((now, float(tokens)))
            requests_admitted.append((now, 1.0))
        assert state.in_flight == len(in_flight) <= policy.max_concurrency
    _check_windows(tokens_admitted, policy.token_capacity, policy.tpm / 60.0)
    _check_windows(requests_admitted, policy.request_capacity, policy.rpm / 60.0)


@SETTINGS
@given(policy=policies(), start=st.floats(0.0, 2e9), trace=st.lists(steps, max_size=60),
       duplicates=st.integers(1, 3))
def test_levels_stay_within_capacity_and_in_flight_never_negative(
    policy: TenantPolicy, start: float, trace: list[Step], duplicates: int
) -> None:
    """With refunds, overuse and duplicate settles (at-least-once delivery)."""
    now, state = start, TenantState.full(policy, start)
    in_flight: list[int] = []
    for step in trace:
        now += step.dt(policy)
        if step.settle_oldest and in_flight:
            reserved = in_flight.pop(0)
            for _ in range(duplicates):
                state = settle(state, policy, reserved, int(reserved * step.used_fraction), now)
        tokens = step.tokens(policy)
        state, throttle = try_consume(state, policy, tokens, now)
        if throttle is None:
            in_flight.append(tokens)
        assert -policy.token_capacity <= state.tokens <= policy.token_capacity
        assert 0.0 <= state.requests <= policy.request_capacity
        assert 0 <= state.in_flight <= policy.max_concurrency


@SETTINGS
@given(
    policy=policies(),
    updated_at=st.floats(0.0, 2e9),
    elapsed=st.floats(0.0, 120.0),
    request_share=st.floats(0.0, 1.0),
    token_share=st.floats(0.0, 1.0),
    tokens=st.integers(0, 10_000_000),
)
def test_retry_after_is_exact(
    policy: TenantPolicy,
    updated_at: float,
    elapsed: float,
    request_share: float,
    token_share: float,
    tokens: int,
) -> None:
    """Retrying at now + retry_after passes; retrying a little earlier does not."""
    state = TenantState(
        policy.request_capacity * request_share, policy.token_capacity * token_share, updated_at
    )
    now = updated_at + elapsed
    _, throttle = try_consume(state, policy, tokens, now)
    if throttle is None or throttle.retry_after_s is None:
        return
    assert throttle.limit in ("requests", "tokens")
    retry = throttle.retry_after_s
    assert retry > 0.0
    assert try_consume(state, policy, tokens, now + retry)[1] is None
    early = 1e-5 + 1e-6 * retry
    if retry > early:
        assert try_consume(state, policy, tokens, now + retry - early)[1] is not None


@SETTINGS
@given(policy=policies(), share=st.floats(0.0, 1.0), extra=st.integers(1, 10**9))
def test_a_request_above_the_bucket_is_refused_for_good_without_retry_after(
    policy: TenantPolicy, share: float, extra: int
) -> None:
    tokens = int(policy.token_capacity) + extra
    state = TenantState(policy.request_capacity, policy.token_capacity * share, 0.0)
    _, throttle = try_consume(state, policy, tokens, 1e9)
    assert throttle is not None
    assert (throttle.limit, throttle.retry_after_s) == ("burst", None)
