"""Token buckets, concurrency caps and usage correction (services.ingest.core.rate_limit)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.ingest.core import (
    ConfigError,
    TenantPolicy,
    TenantState,
    policies_from_mapping,
    refilled,
    settle,
    try_consume,
)
from tests.builders_ingest import make_policy, make_state

# rpm 60 → 1 request/s; tpm 60,000 → 1,000 tokens/s; capacities one minute's worth.
POLICY = make_policy(rpm=60.0, tpm=60_000.0, max_concurrency=2)


@pytest.mark.parametrize(
    ("state", "tokens", "limit", "retry_after_s"),
    [
        (make_state(POLICY), 60_001, "burst", None),
        (make_state(POLICY, in_flight=2), 10, "concurrency", 1.0),  # a slot frees unannounced
        (make_state(POLICY, tokens=500.0), 1_500, "tokens", 1.0),
        (make_state(POLICY, tokens=0.0), 250, "tokens", 0.25),
        (make_state(POLICY, requests=0.0), 10, "requests", 1.0),
        (make_state(POLICY, requests=0.5, tokens=0.0), 2_000, "tokens", 2.0),
        (make_state(POLICY, requests=0.0, tokens=900.0), 1_000, "requests", 1.0),
    ],
)
def test_try_consume_refusals(
    state: TenantState, tokens: int, limit: str, retry_after_s: float | None
) -> None:
    after, throttle = try_consume(state, POLICY, tokens, now=0.0)
    assert after is state  # a refusal costs nothing
    assert throttle is not None
    assert throttle.limit == limit
    assert throttle.retry_after_s == pytest.approx(retry_after_s)
    assert POLICY.tenant in throttle.reason


def test_try_consume_takes_one_request_tokens_and_a_slot() -> None:
    after, throttle = try_consume(make_state(POLICY), POLICY, 1_234, now=0.0)
    assert throttle is None
    assert after == TenantState(59.0, 60_000.0 - 1_234, 0.0, 1)


def test_burst_refusal_says_it_can_never_pass() -> None:
    _, throttle = try_consume(make_state(POLICY), POLICY, 70_000, now=0.0)
    assert throttle is not None and "ever" in throttle.reason


def test_retry_at_retry_after_succeeds_and_just_before_fails() -> None:
    state = make_state(POLICY, now=1_700_000_000.0, tokens=123.0)
    _, throttle = try_consume(state, POLICY, 5_000, now=1_700_000_000.5)
    assert throttle is not None and throttle.retry_after_s is not None
    retry_at = 1_700_000_000.5 + throttle.retry_after_s
    assert try_consume(state, POLICY, 5_000, retry_at)[1] is None
    assert try_consume(state, POLICY, 5_000, retry_at - 1e-3)[1] is not None


def test_buckets_refill_continuously_and_cap_at_capacity() -> None:
    state = make_state(POLICY, requests=0.0, tokens=0.0)
    assert refilled(state, POLICY, 2.5) == TenantState(2.5, 2_500.0, 2.5, 0)
    assert refilled(state, POLICY, 3_600.0) == TenantState(60.0, 60_000.0, 3_600.0, 0)


def test_clock_going_backwards_refills_nothing_and_waits_for_the_stamp() -> None:
    state = make_state(POLICY, now=10.0, tokens=0.0)
    assert refilled(state, POLICY, 5.0) is state
    _, throttle = try_consume(state, POLICY, 1_000, now=9.0)
    assert throttle is not None and throttle.retry_after_s == pytest.approx(2.0)


def test_a_stamp_far_ahead_of_the_clock_does_not_lock_the_tenant_out_until_then() -> None:
    # Written by an agent whose clock ran 1,000 s ahead: refills nothing, waits for nothing.
    state = make_state(POLICY, now=11_000.0, tokens=0.0)
    assert refilled(state, POLICY, 10_000.0) == replace(state, updated_at=10_000.0)
    _, throttle = try_consume(state, POLICY, 1_000, now=10_000.0)
    assert throttle is not None and throttle.retry_after_s == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("tokens_before", "reserved", "used", "tokens_after"),
    [
        (1_000.0, 500, 200, 1_300.0),  # refund of the unused 300
        (59_900.0, 500, 0, 60_000.0),  # refund capped at capacity
        (1_000.0, 500, 500, 1_000.0),  # exact estimate: nothing changes
        (1_000.0, 500, 800, 700.0),  # usage above the reservation is charged
        (100.0, 500, 5_000, -4_400.0),  # ...into debt, paid by refill before the next
        (100.0, 500, 200_000, -60_000.0),  # ...of one capacity at most
    ],
)
def test_settle_corrects_the_token_bucket(
    tokens_before: float, reserved: int, used: int, tokens_after: float
) -> None:
    state = make_state(POLICY, tokens=tokens_before, in_flight=1)
    after = settle(state, POLICY, reserved, used, now=0.0)
    assert after.tokens == pytest.approx(tokens_after)
    assert after.in_flight == 0
    assert after.requests == state.requests


def test_duplicate_settle_is_bounded_by_capacity_and_zero_in_flight() -> None:
    state = make_state(POLICY, tokens=59_000.0, in_flight=1)
    once = settle(state, POLICY, 1_000, 0, now=0.0)
    twice = settle(once, POLICY, 1_000, 0, now=0.0)
    assert once.tokens == twice.tokens == 60_000.0
    assert once.in_flight == twice.in_flight == 0


def test_settle_releases_a_concurrency_slot() -> None:
    state = make_state(POLICY, in_flight=2)
    assert try_consume(state, POLICY, 1, 0.0)[1] is not None
    assert try_consume(settle(state, POLICY, 1, 1, 0.0), POLICY, 1, 0.0)[1] is None


def test_state_round_trips_through_a_dict() -> None:
    state = TenantState(3.5, 1234.25, 1_700_000_000.125, 3)
    data = state.to_dict()
    assert all(isinstance(v, int | float) for v in data.values())
    assert TenantState.from_dict(data) == state
    assert TenantState.from_dict({**data, "requests": 3}) == TenantState(3.0, 1234.25,
                                                                         1_700_000_000.125, 3)


@pytest.mark.parametrize(
    "data",
    [{"tokens": 1.0, "updated_at": 0.0, "in_flight": 0},
     {"requests": "1", "tokens": 1.0, "updated_at": 0.0, "in_flight": 0},
     {"requests": 1.0, "tokens": 1.0, "updated_at": 0.0, "in_flight": 1.5},
     {"requests": 1.0, "tokens": 1.0, "updated_at": True, "in_flight": 0}],
)
def test_state_from_bad_dict_raises(data: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="tenant state"):
        TenantState.from_dict(data)


def test_policy_capacities_default_to_a_minute_of_rate() -> None:
    assert (POLICY.request_capacity, POLICY.token_capacity) == (60.0, 60_000.0)
    burst = make_policy(rpm=60.0, tpm=600.0, request_burst=5.0, token_burst=100.0)
    assert (burst.request_capacity, burst.token_capacity) == (5.0, 100.0)


def test_policy_from_mapping() -> None:
    policy = TenantPolicy.from_mapping("acme", {
        "rpm": 600, "tpm": 200_000, "max_concurrency": 32, "max_priority": "high",
        "allowed_models": ["llama-3.1-8b"], "may_set_lane": True, "token_burst": 50_000,
    })
    assert policy == TenantPolicy(
        "acme", 600.0, 200_000.0, 32, None, 50_000.0, frozenset({"llama-3.1-8b"}), "high", True
    )
    assert policies_from_mapping({"acme": {"rpm": 1, "tpm": 1, "max_concurrency": 1}})[
        "acme"
    ].max_priority == "normal"


@pytest.mark.parametrize(
    ("overrides", "setting"),
    [
        ({"rpm": 0}, "tenants.acme.rpm"),
        ({"rpm": -5}, "tenants.acme.rpm"),
        ({"tpm": float("inf")}, "tenants.acme.tpm"),
        ({"tpm": "lots"}, "tenants.acme.tpm"),
        ({"max_concurrency": 0}, "tenants.acme.max_concurrency"),
        ({"max_concurrency": 1.5}, "tenants.acme.max_concurrency"),
        ({"request_burst": 0.5}, "tenants.acme.request_burst"),
        # one request per two minutes with the default burst (= rpm): a bucket of 0.5
        # requests never holds one, so every request would be refused forever
        ({"rpm": 0.5}, "tenants.acme.rpm"),
        ({"token_burst": -1}, "tenants.acme.token_burst"),
        ({"max_priority": "urgent"}, "tenants.acme.max_priority"),
        ({"may_set_lane": "yes"}, "tenants.acme.may_set_lane"),
        ({"allowed_models": "llama-3.1-8b"}, "tenants.acme.allowed_models"),
        ({"rmp": 5}, "tenants.acme.rmp"),
    ],
)
def test_policy_from_mapping_names_the_bad_setting(
    overrides: dict[str, object], setting: str
) -> None:
    table = {"rpm": 60, "tpm": 1_000, "max_concurrency": 4, **overrides}
    with pytest.raises(ConfigError) as caught:
        TenantPolicy.from_mapping("acme", table)
    assert caught.value.setting == setting


@pytest.mark.parametrize("missing", ["rpm", "tpm", "max_concurrency"])
def test_policy_from_mapping_requires_rates_and_concurrency(missing: str) -> None:
    table = {"rpm": 60, "tpm": 1_000, "max_concurrency": 4}
    del table[missing]
    with pytest.raises(ConfigError, match="required") as caught:
        TenantPolicy.from_mapping("acme", table)
    assert caught.value.setting == f"tenants.acme.{missing}"


def test_negative_tokens_is_a_caller_bug() -> None:
    with pytest.raises(ValueError, match="tokens"):
        try_consume(make_state(POLICY), POLICY, -1, 0.0)


def test_a_slow_tier_works_with_a_burst_of_one() -> None:
    slow = make_policy(rpm=0.5, request_burst=1.0)
    state = TenantState.full(slow, 0.0)
    state, refused = try_consume(state, slow, 10, 0.0)
    assert refused is None
    _, refused = try_consume(state, slow, 10, 0.0)
    assert refused is not None and refused.retry_after_s == pytest.approx(120.0)


def test_a_tenant_whose_prompts_the_estimate_undercounts_keeps_to_its_tokens_per_minute() -> None:
    # Each request reserves 2,000 tokens (what the estimate says) and uses 8,000 (what
    # the engine counted). Charged only down to an empty bucket, the tenant used about 4x
    # its 60,000 tokens/min (the code before); in debt, refill pays for what it used.
    policy = TenantPolicy("t", rpm=100_000, tpm=60_000, max_concurrency=1_000)
    state, now, used = TenantState.full(policy, 0.0), 0.0, 0
    while now < 600.0:
        state, throttle = try_consume(state, policy, 2_000, now)
        if throttle is None:
            state = settle(state, policy, 2_000, 8_000, now)
            used += 8_000
        now += 0.5
    # At most one capacity at the start, the refill of 10 minutes, and one request more.
    assert used <= policy.token_capacity + 60_000 * 10 + 8_000
