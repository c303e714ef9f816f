"""Validated, frozen config of the ingest core, built from plain dicts (parsed TOML/YAML).

Every bound is checked in ``from_mapping``; a bad value raises
:class:`~services.ingest.core.errors.ConfigError` naming the setting. No env reads here:
the service's settings layer reads files and env once and passes the dict down.

Config example (YAML)::

    models:                       # added to / overriding the built-in KNOWN_MODELS
      my-model: {num_layers: 32, num_kv_heads: 8, head_dim: 128, max_model_len: 8192}
    lanes: {threshold: 2000, per_model: {my-model: 4000}}
    overload: {unknown_drain_retry_after_s: 5, max_retry_after_s: 300}
    tenants:
      acme: {rpm: 600, tpm: 200000, max_concurrency: 32, max_priority: high}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from services.ingest.core import _settings as s
from services.ingest.core.classify import LaneConfig
from services.ingest.core.models import DEFAULT_BLOCK_SIZE, ModelRegistry
from services.ingest.core.rate_limit import TenantPolicy, policies_from_mapping

#: Upper bound of any Retry-After we hand out (an hour: beyond it the number means nothing).
RETRY_AFTER_CEILING_S: Final = 3600.0
_ADMISSION_KEYS: Final = (
    "models", "include_known_models", "lanes", "overload", "default_block_size",
)


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Inputs of :func:`~services.ingest.core.admission.admit` besides the request.

    ``default_block_size`` sizes KV for a model that live workers serve but the registry
    does not know. ``unknown_drain_retry_after_s`` (default 5 s, in (0, 3600]) is the
    Retry-After of a fail-closed ``overloaded`` when no drain rate is measured;
    ``max_retry_after_s`` (default 300 s) caps every computed ``overloaded`` Retry-After.
    """

    registry: ModelRegistry = field(default_factory=ModelRegistry.from_mapping)
    lanes: LaneConfig = field(default_factory=LaneConfig)
    default_block_size: int = DEFAULT_BLOCK_SIZE
    unknown_drain_retry_after_s: float = 5.0
    max_retry_after_s: float = 300.0

    def __post_init__(self) -> None:
        s.positive_int(self.default_block_size, "default_block_size")
        s.positive_float(
            self.unknown_drain_retry_after_s, "overload.unknown_drain_retry_after_s",
            upper=RETRY_AFTER_CEILING_S,
        )
        s.positive_float(
            self.max_retry_after_s, "overload.max_retry_after_s", upper=RETRY_AFTER_CEILING_S
        )

    @classmethod
    def from_mapping(cls, mapping: object = None) -> AdmissionConfig:
        """Validate ``models``, ``include_known_models``, ``lanes``, ``overload`` and
        ``default_block_size``; unknown keys are refused."""
        table = s.section(mapping or {}, "(root)")
        s.known_keys(table, _ADMISSION_KEYS, "")
        include_known = s.boolean(table.get("include_known_models", True), "include_known_models")
        registry = ModelRegistry.from_mapping(
            s.section(table.get("models") or {}, "models"), include_known=include_known
        )
        overload = s.section(table.get("overload") or {}, "overload")
        s.known_keys(overload, ("unknown_drain_retry_after_s", "max_retry_after_s"), "overload")
        return cls(
            registry=registry,
            lanes=LaneConfig.from_mapping(table.get("lanes"), registry=registry),
            default_block_size=s.positive_int(
                table.get("default_block_size", DEFAULT_BLOCK_SIZE), "default_block_size"
            ),
            unknown_drain_retry_after_s=s.positive_float(
                overload.get("unknown_drain_retry_after_s", 5.0),
                "overload.unknown_drain_retry_after_s", upper=RETRY_AFTER_CEILING_S,
            ),
            max_retry_after_s=s.positive_float(
                overload.get("max_retry_after_s", 300.0), "overload.max_retry_after_s",
                upper=RETRY_AFTER_CEILING_S,
            ),
        )


@dataclass(frozen=True, slots=True)
class IngestConfig:
    """The whole ingest-core config: admission settings plus one policy per tenant."""

    admission: AdmissionConfig
    tenants: Mapping[str, TenantPolicy]

    @classmethod
    def from_mapping(cls, mapping: object) -> IngestConfig:
        """Split ``tenants`` off and validate both parts."""
        table = dict(s.section(mapping or {}, "(root)"))
        tenants = policies_from_mapping(table.pop("tenants", {}))
        return cls(AdmissionConfig.from_mapping(table), MappingProxyType(tenants))
