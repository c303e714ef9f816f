"""Builders for the ingest core's values: sensible defaults, override what the test is about."""

from __future__ import annotations

from collections.abc import Iterable

from schemas.common import Lane, Priority
from services.ingest.core import (
    AdmissionConfig,
    AdmissionRequest,
    ClusterView,
    ModelCapacity,
    TenantPolicy,
    TenantState,
)

MODEL = "llama-3.1-8b"


def make_policy(
    tenant: str = "acme",
    *,
    rpm: float = 60.0,
    tpm: float = 60_000.0,
    max_concurrency: int = 8,
    request_burst: float | None = None,
    token_burst: float | None = None,
    allowed_models: Iterable[str] | None = None,
    max_priority: Priority = "high",
    may_set_lane: bool = False,
) -> TenantPolicy:
    return TenantPolicy(
        tenant=tenant,
        rpm=rpm,
        tpm=tpm,
        max_concurrency=max_concurrency,
        request_burst=request_burst,
        token_burst=token_burst,
        allowed_models=None if allowed_models is None else frozenset(allowed_models),
        max_priority=max_priority,
        may_set_lane=may_set_lane,
    )


def make_state(
    policy: TenantPolicy,
    now: float = 0.0,
    *,
    requests: float | None = None,
    tokens: float | None = None,
    in_flight: int = 0,
) -> TenantState:
    """Full buckets at ``now`` unless levels are given."""
    return TenantState(
        policy.request_capacity if requests is None else requests,
        policy.token_capacity if tokens is None else tokens,
        now,
        in_flight,
    )


def make_request(
    request_id: str = "r1",
    *,
    tenant: str = "acme",
    model: str = MODEL,
    prompt_tokens: int = 100,
    max_tokens: int = 100,
    priority: Priority = "normal",
    lane_hint: Lane | None = None,
    timeout_s: float = 60.0,
) -> AdmissionRequest:
    return AdmissionRequest(
        request_id=request_id,
        tenant=tenant,
        model=model,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        priority=priority,
        lane_hint=lane_hint,
        timeout_s=timeout_s,
    )


def make_capacity(
    model: str = MODEL,
    *,
    live_workers: int = 2,
    max_usable_kv_tokens: int = 200_000,
    queued_tokens: int = 0,
    drain_tokens_per_s: float = 10_000.0,
    max_model_len: int | None = None,
    kv_headroom_tokens: int = 0,
    block_size: int | None = None,
) -> ModelCapacity:
    return ModelCapacity(
        model=model,
        live_workers=live_workers,
        max_usable_kv_tokens=max_usable_kv_tokens,
        queued_tokens=queued_tokens,
        drain_tokens_per_s=drain_tokens_per_s,
        max_model_len=max_model_len,
        kv_headroom_tokens=kv_headroom_tokens,
        block_size=block_size,
    )


def make_cluster(*capacities: ModelCapacity) -> ClusterView:
    """One healthy capacity for MODEL when none are given."""
    return ClusterView.of(capacities or (make_capacity(),))


def make_config(mapping: dict[str, object] | None = None) -> AdmissionConfig:
    return AdmissionConfig.from_mapping(mapping)
