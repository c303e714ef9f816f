"""Validated config of the ingest core (services.ingest.core.config)."""

from __future__ import annotations

import pytest

from services.ingest.core import AdmissionConfig, ConfigError, IngestConfig

FOO = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 64, "max_model_len": 512}


def test_defaults() -> None:
    config = AdmissionConfig.from_mapping(None)
    assert config.lanes.threshold == 2000
    assert config.default_block_size == 16
    assert (config.unknown_drain_retry_after_s, config.max_retry_after_s) == (5.0, 300.0)
    assert "llama-3.1-8b" in config.registry


def test_full_mapping() -> None:
    config = IngestConfig.from_mapping({
        "models": {"foo": FOO},
        "include_known_models": False,
        "lanes": {"threshold": 1000, "per_model": {"foo": 300}},
        "overload": {"unknown_drain_retry_after_s": 2, "max_retry_after_s": 60},
        "default_block_size": 32,
        "tenants": {"acme": {"rpm": 60, "tpm": 6000, "max_concurrency": 2}},
    })
    admission = config.admission
    assert [shape.name for shape in admission.registry] == ["foo"]
    assert admission.lanes.threshold_for("foo") == 300
    assert (admission.unknown_drain_retry_after_s, admission.max_retry_after_s) == (2.0, 60.0)
    assert admission.default_block_size == 32
    assert config.tenants["acme"].tpm == 6000.0


@pytest.mark.parametrize(
    ("mapping", "setting"),
    [
        ({"models": {"foo": {**FOO, "num_kv_heads": 0}}}, "models.foo.num_kv_heads"),
        ({"models": {"foo": {**FOO, "head_dim": -64}}}, "models.foo.head_dim"),
        ({"lanes": {"threshold": 0}}, "lanes.threshold"),
        ({"lanes": {"per_model": {"foo": 100}}}, "lanes.per_model.foo"),  # no shape for foo
        ({"include_known_models": False, "lanes": {"per_model": {"llama-3.1-8b": 100}}},
         "lanes.per_model.llama-3.1-8b"),
        ({"overload": {"unknown_drain_retry_after_s": -1}},
         "overload.unknown_drain_retry_after_s"),
        ({"overload": {"max_retry_after_s": 0}}, "overload.max_retry_after_s"),
        ({"overload": {"max_retry_after_s": 86_400}}, "overload.max_retry_after_s"),
        ({"overload": {"retry": 1}}, "overload.retry"),
        ({"default_block_size": 0}, "default_block_size"),
        ({"include_known_models": "no"}, "include_known_models"),
        ({"modles": {}}, "modles"),
        ({"tenants": {"acme": {"rpm": -1, "tpm": 1, "max_concurrency": 1}}}, "tenants.acme.rpm"),
    ],
)
def test_bad_settings_are_named(mapping: dict[str, object], setting: str) -> None:
    with pytest.raises(ConfigError) as caught:
        IngestConfig.from_mapping(mapping)
    assert caught.value.setting == setting
    assert str(caught.value).startswith(setting)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)
