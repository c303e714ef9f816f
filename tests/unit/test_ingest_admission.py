"""The admit/reject decision (services.ingest.core.admission): every code, in order."""

from __future__ import annotations

from dataclasses import replace

import pytest

from schemas.common import HTTP_STATUS, MAX_TOKENS, ErrorCode, Lane, Priority
from services.ingest.core import (
    AdmissionRequest,
    Admit,
    ClusterView,
    Reject,
    TenantPolicy,
    TenantState,
    admit,
)
from tests.builders_ingest import (
    make_capacity,
    make_cluster,
    make_config,
    make_policy,
    make_request,
    make_state,
)

NOW = 1_000.0
POLICY = make_policy(rpm=60.0, tpm=60_000.0, max_concurrency=2)  # 1 req/s, 1,000 tokens/s
CONFIG = make_config()


def decide(
    request: AdmissionRequest | None = None,
    policy: TenantPolicy = POLICY,
    state: TenantState | None = None,
    cluster: ClusterView | None = None,
) -> Admit | Reject:
    return admit(
        request or make_request(),
        policy,
        state or make_state(policy, NOW),
        cluster or make_cluster(),
        NOW,
        config=CONFIG,
    )


# (case, request, policy, state, cluster, code, check, retry_after_s)
REJECTS = [
    ("max_tokens zero", make_request(max_tokens=0), POLICY, None, None,
     "invalid", "invalid_request", None),
    ("negative prompt", make_request(prompt_tokens=-1), POLICY, None, None,
     "invalid", "invalid_request", None),
    ("zero timeout", make_request(timeout_s=0.0), POLICY, None, None,
     "invalid", "invalid_request", None),
    ("nan timeout", make_request(timeout_s=float("nan")), POLICY, None, None,
     "invalid", "invalid_request", None),
    ("invalid before unknown model", make_request(model="nope", max_tokens=0), POLICY, None,
     None, "invalid", "invalid_request", None),
    ("unknown model", make_request(model="gpt-9"), POLICY, None, None,
     "unknown_model", "unknown_model", None),
    # Seen lately (a drain, a restart): retryable, not "does not exist" (found by an audit).
    ("unregistered model, no live worker", make_request(model="custom/x"), POLICY, None,
     make_cluster(make_capacity("custom/x", live_workers=0)),
     "overloaded", "no_live_workers", CONFIG.unknown_drain_retry_after_s),
    ("model not allowed", make_request(), make_policy(allowed_models=["qwen2.5-7b"]), None,
     None, "unknown_model", "model_not_allowed", None),
    ("over the registry's max_model_len", make_request(model="llama-3-8b", prompt_tokens=8000,
     max_tokens=193), POLICY, None, make_cluster(make_capacity("llama-3-8b")),
     "too_large", "max_model_len", None),
    ("over the heartbeat's max_model_len", make_request(prompt_tokens=4000, max_tokens=97),
     POLICY, None, make_cluster(make_capacity(max_model_len=4096)),
     "too_large", "max_model_len", None),
    ("KV above the largest worker", make_request(prompt_tokens=1000, max_tokens=100), POLICY,
     None, make_cluster(make_capacity(max_usable_kv_tokens=1100)),
     "too_large", "kv_capacity", None),
    ("larger than the tenant's bucket", make_request(prompt_tokens=900, max_tokens=200),
     make_policy(token_burst=1000.0), None, None, "too_large", "tenant_burst", None),
    ("too large before rate limited", make_request(prompt_tokens=1000, max_tokens=100), POLICY,
     make_state(POLICY, NOW, in_flight=2), make_cluster(make_capacity(max_usable_kv_tokens=16)),
     "too_large", "kv_capacity", None),
    ("concurrency cap", make_request(), POLICY, make_state(POLICY, NOW, in_flight=2), None,
     "rate_limited", "concurrency", 1.0),
    ("token bucket", make_request(prompt_tokens=150, max_tokens=50), POLICY,
     make_state(POLICY, NOW, tokens=0.0), None, "rate_limited", "tokens", 0.2),
    ("request bucket", make_request(), POLICY, make_state(POLICY, NOW, requests=0.25), None,
     "rate_limited", "requests", 0.75),
    # 1 token a minute, a bucket of a million: an exact wait of ~200 min, capped at an hour.
    ("a bucket's wait past the ceiling", make_request(), make_policy(tpm=1.0, token_burst=1e6),
     make_state(make_policy(tpm=1.0, token_burst=1e6), NOW, tokens=0.0), None,
     "rate_limited", "tokens", 3600.0),
    ("rate limited before overloaded", make_request(), POLICY,
     make_state(POLICY, NOW, requests=0.0), make_cluster(make_capacity(live_workers=0)),
     "rate_limited", "requests", 1.0),
    ("no live workers", make_request(), POLICY, None, make_cluster(make_capacity(live_workers=0)),
     "overloaded", "no_live_workers", 5.0),
    ("empty fleet", make_request(), POLICY, None, ClusterView(),
     "overloaded", "no_live_workers", 5.0),
    ("queue with unknown drain", make_request(), POLICY, None,
     make_cluster(make_capacity(queued_tokens=100, drain_tokens_per_s=0.0)),
     "overloaded", "drain_unknown", 5.0),
    # make_request() needs 200 tokens: 100 queued + 200 does not fit in 299 free.
    ("unknown drain, backlog beyond the free KV", make_request(), POLICY, None,
     make_cluster(make_capacity(queued_tokens=100, drain_tokens_per_s=0.0,
                                kv_headroom_tokens=299)),
     "overloaded", "drain_unknown", 5.0),
    # 100 queued at 1/s, 10 s timeout, needs 200 — and 299 free KV is not enough to start
    # it all at once either.
    ("slow drain and too little free KV", make_request(timeout_s=10.0), POLICY, None,
     make_cluster(make_capacity(queued_tokens=100, drain_tokens_per_s=1.0,
                                kv_headroom_tokens=299)),
     "overloaded", "queue_backlog", 100.0),
    ("queue with NaN drain", make_request(), POLICY, None,
     make_cluster(make_capacity(queued_tokens=100, drain_tokens_per_s=float("nan"))),
     "overloaded", "drain_unknown", 5.0),
    # 1e6 queued, 10k/s × 60 s = 600k drainable: (1e6 + 200 − 600k) / 10k = 40.02 s.
    ("backlog", make_request(), POLICY, None,
     make_cluster(make_capacity(queued_tokens=1_000_000, drain_tokens_per_s=10_000.0)),
     "overloaded", "queue_backlog", 40.02),
    # 100 queued at 1/s, 10 s timeout, needs 200: waiting for the queue to empty (100 s) is
    # enough, since an empty queue never rejects.
    ("backlog shorter than the request", make_request(timeout_s=10.0), POLICY, None,
     make_cluster(make_capacity(queued_tokens=100, drain_tokens_per_s=1.0)),
     "overloaded", "queue_backlog", 100.0),
    ("backlog retry capped", make_request(), POLICY, None,
     make_cluster(make_capacity(queued_tokens=10**9, drain_tokens_per_s=1_000.0)),
     "overloaded", "queue_backlog", 300.0),
]


@pytest.mark.parametrize(
    ("request_", "policy", "state", "cluster", "code", "check", "retry_after_s"),
    [pytest.param(*case[1:], id=case[0]) for case in REJECTS],
)
def test_rejects(
    request_: AdmissionRequest,
    policy: TenantPolicy,
    state: TenantState | None,
    cluster: ClusterView | None,
    code: ErrorCode,
    check: str,
    retry_after_s: float | None,
) -> None:
    result = decide(request_, policy, state, cluster)
    assert isinstance(result, Reject), result
    assert (result.code, result.check) == (code, check)
    assert result.retry_after_s == pytest.approx(retry_after_s)
    assert result.reason


def test_every_admission_code_is_covered() -> None:
    codes = {case[5] for case in REJECTS}
    assert codes == {"invalid", "unknown_model", "too_large", "rate_limited", "overloaded"}
    statuses = {status for code, status in HTTP_STATUS.items() if code in codes}
    assert statuses == {400, 404, 413, 429, 503}


def test_unknown_and_disallowed_models_read_the_same_to_the_client() -> None:
    disallowed = decide(make_request(model="qwen2.5-7b"),
                        policy=make_policy(allowed_models=["llama-3.1-8b"]))
    missing = decide(make_request(model="qwen2.5-7c"))
    assert isinstance(disallowed, Reject) and isinstance(missing, Reject)
    assert disallowed.code == missing.code == "unknown_model"
    assert disallowed.reason.replace("2.5-7b", "") == missing.reason.replace("2.5-7c", "")


@pytest.mark.parametrize(
    ("requested", "maximum", "effective", "lowered_from"),
    [
        ("high", "high", "high", None),
        ("high", "normal", "normal", "high"),
        ("high", "low", "low", "high"),
        ("normal", "low", "low", "normal"),
        ("normal", "high", "normal", None),
        ("low", "high", "low", None),
        ("low", "low", "low", None),
    ],
)
def test_priority_above_the_tenant_maximum_is_lowered(
    requested: Priority, maximum: Priority, effective: Priority, lowered_from: Priority | None
) -> None:
    result = decide(make_request(priority=requested), make_policy(max_priority=maximum))
    assert isinstance(result, Admit)
    assert (result.priority, result.lowered_from) == (effective, lowered_from)


def test_admit_reserves_prompt_plus_max_tokens_in_whole_blocks() -> None:
    state = make_state(POLICY, NOW)
    result = decide(make_request(model="meta-llama/Llama-3.1-8B-Instruct", prompt_tokens=100,
                                 max_tokens=100), state=state)
    assert isinstance(result, Admit)
    assert result.model == "llama-3.1-8b"  # the alias resolved to the canonical name
    assert (result.prompt_tokens, result.kv_tokens, result.reserved_tokens) == (100, 208, 200)
    assert result.lane == "short"
    assert result.new_state == replace(state, requests=state.requests - 1,
                                       tokens=state.tokens - 200, in_flight=1)


def test_the_kv_reservation_is_rounded_to_the_live_workers_block_size() -> None:
    # The registry says 16; the fleet runs blocks of 64, and the scheduler rounds to them.
    request = make_request(prompt_tokens=100, max_tokens=100)
    result = decide(request, cluster=make_cluster(make_capacity(block_size=64)))
    assert isinstance(result, Admit) and result.kv_tokens == 256
    refused = decide(request, cluster=make_cluster(make_capacity(block_size=64,
                                                                 max_usable_kv_tokens=250)))
    assert isinstance(refused, Reject) and refused.check == "kv_capacity"


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "hint", "may_set_lane", "lane"),
    [(1000, 1000, None, False, "short"), (1000, 1001, None, False, "long"),
     (100, 100, "long", True, "long"), (100, 100, "long", False, "short")],
)
def test_admit_classifies_the_lane(
    prompt: int, max_tokens: int, hint: Lane | None, may_set_lane: bool, lane: Lane
) -> None:
    request = make_request(prompt_tokens=prompt, max_tokens=max_tokens, lane_hint=hint)
    result = decide(request, make_policy(may_set_lane=may_set_lane))
    assert isinstance(result, Admit) and result.lane == lane


def test_model_served_by_live_workers_but_not_registered_is_admitted() -> None:
    config = make_config({"default_block_size": 32})
    result = admit(make_request(model="custom/x", prompt_tokens=10, max_tokens=10), POLICY,
                   make_state(POLICY, NOW), make_cluster(make_capacity("custom/x")), NOW,
                   config=config)
    assert isinstance(result, Admit)
    assert (result.model, result.kv_tokens) == ("custom/x", 32)


def test_allowed_models_match_any_alias() -> None:
    policy = make_policy(allowed_models=["meta-llama/Llama-3.1-8B-Instruct"])
    assert isinstance(decide(make_request(model="llama-3.1-8b"), policy), Admit)


@pytest.mark.parametrize(
    ("queued", "drain", "timeout_s"),
    [(0, 0.0, 60.0), (0, float("nan"), 1.0), (599_800, 10_000.0, 60.0)],
)
def test_admits_when_the_queue_is_empty_or_drains_in_time(
    queued: int, drain: float, timeout_s: float
) -> None:
    cluster = make_cluster(make_capacity(queued_tokens=queued, drain_tokens_per_s=drain))
    assert isinstance(decide(make_request(timeout_s=timeout_s), cluster=cluster), Admit)


@pytest.mark.parametrize("drain", [0.0, float("nan"), 0.5])
def test_a_backlog_the_free_kv_can_start_at_once_is_admitted_whatever_the_drain(
    drain: float,
) -> None:
    # 100 queued + 200 needed = 300 = the fleet's free KV: everything can start now. A
    # fleet that was idle measured almost no drain (0.5 tokens/s of one warm-up request).
    cluster = make_cluster(make_capacity(queued_tokens=100, drain_tokens_per_s=drain,
                                         kv_headroom_tokens=300))
    assert isinstance(decide(make_request(), cluster=cluster), Admit)


def test_cluster_view_keyed_by_served_name_is_found_too() -> None:
    served = "meta-llama/Llama-3.1-8B-Instruct"
    cluster = make_cluster(make_capacity(served, live_workers=1))
    assert isinstance(decide(make_request(model=served), cluster=cluster), Admit)


def test_policy_of_another_tenant_is_a_caller_bug() -> None:
    with pytest.raises(ValueError, match="policy of"):
        decide(make_request(tenant="other"))


def test_a_prompt_over_the_wires_token_bound_is_too_large_not_an_error() -> None:
    # A model not in the registry, on workers with an enormous KV and no max_model_len:
    # nothing else bounds it, and the admitted message could not carry the count.
    OPEN = make_policy(rpm=60.0, tpm=1e10, token_burst=1e10)
    huge = make_cluster(make_capacity("custom/x", max_usable_kv_tokens=1 << 24))
    over = make_request(model="custom/x", prompt_tokens=MAX_TOKENS + 1, max_tokens=1)
    result = admit(over, OPEN, make_state(OPEN, NOW), huge, NOW, config=CONFIG)
    assert isinstance(result, Reject) and result.code == "too_large"
    assert str(MAX_TOKENS) in result.reason
    at = make_request(model="custom/x", prompt_tokens=MAX_TOKENS, max_tokens=1)
    assert isinstance(admit(at, OPEN, make_state(OPEN, NOW), huge, NOW,
                            config=CONFIG), Admit)
