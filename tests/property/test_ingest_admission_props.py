"""Invariants of admit() (services.ingest.core.admission) over random requests and fleets."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.common import PRIORITIES, Priority, priority_rank
from services.ingest.core import Admit, Reject, admit
from tests.builders_ingest import (
    make_capacity,
    make_cluster,
    make_config,
    make_policy,
    make_request,
    make_state,
)

SETTINGS = settings(max_examples=300, deadline=None)
CONFIG = make_config()
NOW = 1_700_000_000.0


@SETTINGS
@given(
    requested=st.sampled_from(PRIORITIES),
    maximum=st.sampled_from(PRIORITIES),
    prompt=st.integers(0, 20_000),
    max_tokens=st.integers(1, 20_000),
)
def test_admitted_priority_never_exceeds_the_tenant_maximum_and_kv_is_whole_blocks(
    requested: Priority, maximum: Priority, prompt: int, max_tokens: int
) -> None:
    policy = make_policy(max_priority=maximum, tpm=10**9)
    request = make_request(priority=requested, prompt_tokens=prompt, max_tokens=max_tokens)
    result = admit(request, policy, make_state(policy, NOW), make_cluster(), NOW, config=CONFIG)
    assert isinstance(result, Admit), result
    assert priority_rank(result.priority) >= priority_rank(policy.max_priority)
    assert result.priority == requested or result.lowered_from == requested
    assert result.kv_tokens % 16 == 0
    assert 0 <= result.kv_tokens - (prompt + max_tokens) < 16
    assert result.lane == ("short" if prompt + max_tokens <= 2000 else "long")


@SETTINGS
@given(
    queued=st.integers(1, 10**8),
    drain=st.floats(1.0, 1e6),
    timeout_s=st.floats(0.1, 3_600.0),
    need=st.integers(1, 100_000),
)
def test_overloaded_retry_after_is_when_the_backlog_would_fit(
    queued: int, drain: float, timeout_s: float, need: int
) -> None:
    """With no new arrivals, the queue left after retry_after seconds admits the request."""
    policy = make_policy(tpm=10**9, rpm=10**6)
    request = make_request(prompt_tokens=need - 1, max_tokens=1, timeout_s=timeout_s)
    capacity = make_capacity(queued_tokens=queued, drain_tokens_per_s=drain,
                             max_usable_kv_tokens=10**9)
    state = make_state(policy, NOW)
    result = admit(request, policy, state, make_cluster(capacity), NOW, config=CONFIG)
    if isinstance(result, Admit):
        assert queued + need <= drain * timeout_s
        return
    assert isinstance(result, Reject) and result.code == "overloaded"
    assert result.retry_after_s is not None and 0.0 < result.retry_after_s <= 300.0
    if result.retry_after_s == 300.0:
        return  # capped: no promise
    left = max(0, int(queued - drain * result.retry_after_s * (1 - 1e-9)) - 1)
    later = replace(capacity, queued_tokens=left)
    retried = admit(request, policy, state, make_cluster(later), NOW, config=CONFIG)
    assert isinstance(retried, Admit), (left, retried)
