"""The tenants file: hashed API keys → tenants, policies, and clear errors for bad files."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from services.ingest.tenants import (
    DEFAULT_TENANT,
    OPEN_POLICY,
    AuthFailure,
    TenantsFileError,
    hash_api_key,
    load_tenancy,
)

ACME = hash_api_key("acme-secret")
ACME2 = hash_api_key("acme-other")
BETA = hash_api_key("beta-secret")

TOML = f"""
lanes = {{ threshold = 1000 }}

[tenants.acme]
api_key_sha256 = ["{ACME}", "{ACME2}"]
rpm = 600
tpm = 200000
max_concurrency = 32
max_priority = "high"

[tenants.beta]
api_key_sha256 = "{BETA}"
rpm = 60
tpm = 1000
max_concurrency = 2
"""

YAML = f"""
tenants:
  acme:
    api_key_sha256: {ACME}
    rpm: 600
    tpm: 200000
    max_concurrency: 32
"""


def _write(tmp_path: Path, text: str, name: str = "tenants.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_toml_file_maps_hashed_keys_to_tenants(tmp_path: Path) -> None:
    tenancy = load_tenancy(_write(tmp_path, TOML))
    assert not tenancy.open
    assert tenancy.authenticate("Bearer acme-secret") == "acme"
    assert tenancy.authenticate("bearer acme-other") == "acme"
    assert tenancy.authenticate("Bearer beta-secret") == "beta"
    acme = tenancy.policy_for("acme")
    assert acme is not None and acme.max_priority == "high" and acme.max_concurrency == 32
    assert tenancy.policy_for("stranger") is None
    assert tenancy.config.admission.lanes.threshold == 1000
    assert "2 tenant(s)" in tenancy.describe()


def test_yaml_file(tmp_path: Path) -> None:
    tenancy = load_tenancy(_write(tmp_path, YAML, "tenants.yaml"))
    assert tenancy.authenticate("Bearer acme-secret") == "acme"


@pytest.mark.parametrize(
    ("header", "why"),
    [(None, "missing"), ("", "missing"), ("Bearer", "malformed"), ("Basic abc", "malformed"),
     ("Bearer wrong", "invalid")],
)
def test_bad_credentials(tmp_path: Path, header: str | None, why: str) -> None:
    found = load_tenancy(_write(tmp_path, TOML)).authenticate(header)
    assert isinstance(found, AuthFailure) and why in found.message


def test_keys_are_never_stored_in_clear(tmp_path: Path) -> None:
    tenancy = load_tenancy(_write(tmp_path, TOML))
    assert "acme-secret" not in repr(tenancy.keys)
    assert hashlib.sha256(b"acme-secret").hexdigest() == ACME


def test_open_mode_without_a_file() -> None:
    tenancy = load_tenancy(None)
    assert tenancy.open and "open mode" in tenancy.describe()
    assert tenancy.authenticate(None) == DEFAULT_TENANT
    assert tenancy.authenticate("Bearer anything") == DEFAULT_TENANT
    assert tenancy.policy_for(DEFAULT_TENANT) == OPEN_POLICY
    other = tenancy.policy_for("kafka-client")
    assert other is not None and other.tenant == "kafka-client" and other.rpm == OPEN_POLICY.rpm


@pytest.mark.parametrize(
    ("text", "setting", "problem"),
    [
        ("[other]\nx = 1\n", "tenants", "at least one"),
        ("[tenants.acme]\nrpm = 1\ntpm = 1\nmax_concurrency = 1\n",
         "tenants.acme.api_key_sha256", "required"),
        ('[tenants.acme]\napi_key_sha256 = "acme-secret"\nrpm = 1\ntpm = 1\n'
         "max_concurrency = 1\n", "tenants.acme.api_key_sha256", "not the key itself"),
        ('[tenants.acme]\napi_key_sha256 = []\nrpm = 1\ntpm = 1\nmax_concurrency = 1\n',
         "tenants.acme.api_key_sha256", "non-empty"),
        (f'[tenants.acme]\napi_key_sha256 = "{ACME}"\nrpm = 1\ntpm = 1\nmax_concurrency = 1\n'
         f'[tenants.beta]\napi_key_sha256 = "{ACME}"\nrpm = 1\ntpm = 1\nmax_concurrency = 1\n',
         "tenants.beta.api_key_sha256", "already belongs to tenant 'acme'"),
        (f'[tenants.acme]\napi_key_sha256 = "{ACME}"\nrpm = 1\ntpm = 1\n',
         "tenants.acme.max_concurrency", "missing"),
        (f'[tenants.acme]\napi_key_sha256 = "{ACME}"\nrpm = 1\ntpm = 1\nmax_concurrency = 1\n'
         "rpmm = 2\n", "tenants.acme.rpmm", "unknown setting"),
        (f'[tenants.acme]\napi_key_sha256 = "{ACME}"\nrpm = -1\ntpm = 1\nmax_concurrency = 1\n',
         "tenants.acme.rpm", "must be"),
        (f'[tenants."a.b"]\napi_key_sha256 = "{ACME}"\nrpm = 1\ntpm = 1\nmax_concurrency = 1\n',
         "tenants.a.b", "tenant names"),
        (f'[tenants.ingest-x]\napi_key_sha256 = "{ACME}"\nrpm = 1\ntpm = 1\n'
         "max_concurrency = 1\n", "tenants.ingest-x", "reserved"),
        ("tenants = [", "", "not valid TOML"),
        # Found by an audit: these raised OverflowError, or were taken for a list.
        (f'[tenants.acme]\napi_key_sha256 = "{ACME}"\nrpm = {"9" * 400}\ntpm = 1\n'
         "max_concurrency = 1\n", "tenants.acme.rpm", "too large for a float"),
        (f'overload = {{ max_retry_after_s = {"9" * 400} }}\n[tenants.acme]\n'
         f'api_key_sha256 = "{ACME}"\nrpm = 1\ntpm = 1\nmax_concurrency = 1\n',
         "overload.max_retry_after_s", "too large for a float"),
        (f'[tenants.acme]\napi_key_sha256 = "{ACME}"\nrpm = 1\ntpm = 1\nmax_concurrency = 1\n'
         "allowed_models = { a = 1 }\n", "tenants.acme.allowed_models", "a list of strings"),
    ],
)
def test_bad_files_name_the_setting(
    tmp_path: Path, text: str, setting: str, problem: str
) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(TenantsFileError) as err:
        load_tenancy(path)
    assert err.value.setting == setting
    assert problem in err.value.problem
    assert str(path) in str(err.value)


def test_unreadable_or_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(TenantsFileError, match="cannot read"):
        load_tenancy(tmp_path / "missing.toml")
    with pytest.raises(TenantsFileError, match=r"\.toml, \.yaml or \.yml"):
        load_tenancy(_write(tmp_path, TOML, "tenants.json"))
    with pytest.raises(TenantsFileError, match="not valid YAML"):
        load_tenancy(_write(tmp_path, "tenants: [", "tenants.yml"))


def test_a_file_that_is_not_utf8_is_one_error_and_a_bom_is_fine(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_bytes(TOML.encode() + b"# caf\xe9\n")  # Latin-1
    with pytest.raises(TenantsFileError, match="must be UTF-8 text"):
        load_tenancy(path)
    path.write_bytes(b"\xef\xbb\xbf" + TOML.encode())  # what some editors write first
    assert load_tenancy(path).policy_for("acme") is not None


def test_a_yaml_key_given_twice_is_refused_not_the_last_kept(tmp_path: Path) -> None:
    """YAML keeps the last of two equal keys: the first tenant's keys and limits vanished."""
    twice = YAML + f"""  acme:
    api_key_sha256: {BETA}
    rpm: 1
    tpm: 1
    max_concurrency: 1
"""
    with pytest.raises(TenantsFileError, match=r"(?s)not valid YAML.*'acme' is given twice"):
        load_tenancy(_write(tmp_path, twice, "tenants.yaml"))
    inner = YAML + "    rpm: 7\n"  # the same setting twice in one tenant
    with pytest.raises(TenantsFileError, match="'rpm' is given twice"):
        load_tenancy(_write(tmp_path, inner, "tenants.yaml"))
    assert load_tenancy(_write(tmp_path, YAML, "tenants.yaml")).policy_for("acme") is not None
