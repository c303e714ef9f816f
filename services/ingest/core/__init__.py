"""Pure decision core of ingest: admission, rate limits, lanes, token and KV estimates.

Owns: token counting (:mod:`.tokens`), model shapes (:mod:`.models`), per-tenant token
buckets and concurrency caps (:mod:`.rate_limit`), lane classification (:mod:`.classify`),
the admit/reject decision (:mod:`.admission`) and the validated config they read
(:mod:`.config`, :mod:`.errors`).

Who may call it: the ingest service's adapters (HTTP API, Faust agents) and the
discrete-event simulator — the same functions in both. Everything here is pure: plain frozen
values in, decisions out, ``now`` passed in; no Kafka, Faust, Consul, vLLM, pynvml, HTTP or
pydantic import, no I/O, no env reads (tests/unit/test_core_purity.py keeps it so). The
caller owns the state it gets back (one agent per tenant key) and performs every side effect.
"""

from services.ingest.core.admission import (
    AdmissionRequest,
    Admit,
    AdmitResult,
    ClusterView,
    ModelCapacity,
    Reject,
    RejectCheck,
    admit,
    fitted_max_tokens,
    may_use_model,
)
from services.ingest.core.classify import DEFAULT_LANE_THRESHOLD, LaneConfig, classify_lane
from services.ingest.core.config import AdmissionConfig, IngestConfig
from services.ingest.core.errors import ConfigError
from services.ingest.core.models import (
    DEFAULT_BLOCK_SIZE,
    KNOWN_MODELS,
    ModelRegistry,
    ModelShape,
)
from services.ingest.core.rate_limit import (
    TenantPolicy,
    TenantState,
    Throttle,
    policies_from_mapping,
    refilled,
    settle,
    try_consume,
)
from services.ingest.core.tokens import (
    ESTIMATE,
    ByteEstimateCounter,
    TokenCounter,
    blocks_for,
    chat_prompt_tokens,
    counter_for,
    counter_from_tokenizer_json,
    kv_bytes_for,
    kv_tokens_for,
    prompt_tokens,
    request_prompt_tokens,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_LANE_THRESHOLD",
    "ESTIMATE",
    "KNOWN_MODELS",
    "AdmissionConfig",
    "AdmissionRequest",
    "Admit",
    "AdmitResult",
    "ByteEstimateCounter",
    "ClusterView",
    "ConfigError",
    "IngestConfig",
    "LaneConfig",
    "ModelCapacity",
    "ModelRegistry",
    "ModelShape",
    "Reject",
    "RejectCheck",
    "TenantPolicy",
    "TenantState",
    "Throttle",
    "TokenCounter",
    "admit",
    "blocks_for",
    "chat_prompt_tokens",
    "classify_lane",
    "counter_for",
    "counter_from_tokenizer_json",
    "fitted_max_tokens",
    "kv_bytes_for",
    "kv_tokens_for",
    "may_use_model",
    "policies_from_mapping",
    "prompt_tokens",
    "refilled",
    "request_prompt_tokens",
    "settle",
    "try_consume",
]
