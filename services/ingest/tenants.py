"""API keys → tenants, and each tenant's policy: the tenants file (``LLMQ_TENANTS_FILE``).

Two modes:

- **open** (no tenants file, the local default): every request is the ``default`` tenant's,
  no API key is needed, limits are generous (:data:`OPEN_POLICY`). Kafka clients that name
  another tenant get the same generous policy under their own name.
- **keyed** (a tenants file): a request needs ``Authorization: Bearer <key>`` whose sha256
  is listed under one tenant; Kafka clients must name a listed tenant.

The file is TOML (``.toml``) or YAML (``.yaml``/``.yml``). It is the whole ingest-core
config (``models``, ``lanes``, ``overload`` as in ``services/ingest/core/config.py``), whose
``tenants.<name>`` tables also carry ``api_key_sha256``: one lowercase hex digest or a list
(keys are never stored in clear)::

    [tenants.acme]
    api_key_sha256 = ["9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"]
    rpm = 600
    tpm = 200000
    max_concurrency = 32
    max_priority = "high"

Hash a key with ``python -c "import hashlib,sys;print(hashlib.sha256(sys.argv[1].encode())
.hexdigest())" KEY``. Every problem is a :class:`TenantsFileError` naming the file and the
setting.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import yaml

from schemas.base import TENANT_PATTERN
from schemas.topics import INSTANCE_REPLIES
from services.ingest.core import ConfigError, IngestConfig, TenantPolicy

DEFAULT_TENANT: Final = "default"
#: The open mode's policy: high enough that only the cluster limits a local user.
OPEN_POLICY: Final = TenantPolicy(
    tenant=DEFAULT_TENANT,
    rpm=600_000.0,
    tpm=1e10,
    max_concurrency=100_000,
    max_priority="high",
    may_set_lane=True,
)
KEY_FIELD: Final = "api_key_sha256"
#: Tenant names that would collide with the ingest instances' reply topics.
RESERVED_PREFIX: Final = INSTANCE_REPLIES
_SHA256_RE: Final = re.compile(r"^[0-9a-f]{64}$")
_TENANT_RE: Final = re.compile(TENANT_PATTERN)


class TenantsFileError(ValueError):
    """The tenants file cannot be read or is invalid; ``setting`` is the dotted path."""

    def __init__(self, path: Path, setting: str, problem: str) -> None:
        where = f"{path}: {setting}" if setting else str(path)
        super().__init__(f"tenants file {where}: {problem}")
        self.path = path
        self.setting = setting
        self.problem = problem


@dataclass(frozen=True, slots=True)
class AuthFailure:
    """Why a request is not authenticated (HTTP 401)."""

    message: str


@dataclass(frozen=True, slots=True)
class Tenancy:
    """Who may call, and under which policy. Built once at start by :func:`load_tenancy`."""

    config: IngestConfig
    #: sha256 hex digest of an API key → tenant name (empty in open mode).
    keys: Mapping[str, str]
    source: Path | None = None

    @property
    def open(self) -> bool:
        """True without a tenants file: no key needed, one generous default policy."""
        return self.source is None

    def authenticate(self, authorization: str | None) -> str | AuthFailure:
        """The tenant of an ``Authorization`` header value, or why not."""
        if self.open:
            return DEFAULT_TENANT
        if not authorization:
            return AuthFailure("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return AuthFailure("malformed Authorization header: expected 'Bearer <key>'")
        tenant = self.keys.get(hash_api_key(key.strip()))
        return tenant if tenant is not None else AuthFailure("invalid API key")

    def metric_label(self, tenant: str) -> str:
        """The tenant as a metric label: listed tenants and ``default`` by name, any other
        (open mode admits every name a Kafka client sends) as ``other``, so the series
        stay bounded."""
        return tenant if tenant in self.config.tenants or tenant == DEFAULT_TENANT else "other"

    def policy_for(self, tenant: str) -> TenantPolicy | None:
        """The tenant's policy; None for a tenant the file does not list (keyed mode), and
        in open mode for a reserved name (its reply topic would be an ingest instance's,
        where HTTP calls wait: a refusal sent there would end one of them)."""
        policy = self.config.tenants.get(tenant)
        if policy is not None or not self.open or tenant.startswith(RESERVED_PREFIX):
            return policy
        return OPEN_POLICY if tenant == DEFAULT_TENANT else dataclasses.replace(
            OPEN_POLICY, tenant=tenant
        )

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.open:
            return (
                "open mode (no LLMQ_TENANTS_FILE): every request is tenant 'default', "
                "no API key needed, generous limits"
            )
        return f"keyed mode: {len(self.config.tenants)} tenant(s) from {self.source}"


def hash_api_key(key: str) -> str:
    """Lowercase hex sha256 of an API key, as the tenants file stores it."""
    return hashlib.sha256(key.encode()).hexdigest()


def open_tenancy() -> Tenancy:
    """The open mode: default admission config, no tenants file."""
    return Tenancy(IngestConfig.from_mapping({}), MappingProxyType({}))


def load_tenancy(path: Path | None) -> Tenancy:
    """The open mode for None, else the validated tenants file at ``path``."""
    if path is None:
        return open_tenancy()
    return parse_tenants(path, _read(path))


def parse_tenants(path: Path, data: object) -> Tenancy:
    """Validate an already-parsed tenants file (``path`` is only for messages)."""
    if not isinstance(data, Mapping):
        raise TenantsFileError(path, "", "must be a table of settings")
    tenants = data.get("tenants")
    if not isinstance(tenants, Mapping) or not tenants:
        raise TenantsFileError(path, "tenants", "at least one tenants.<name> table is required")
    keys: dict[str, str] = {}
    policies: dict[str, object] = {}
    for name, table in tenants.items():
        policies[name] = _split_keys(path, name, table, keys)
    try:
        config = IngestConfig.from_mapping({**data, "tenants": policies})
    except ConfigError as exc:
        raise TenantsFileError(path, exc.setting, exc.problem) from None
    return Tenancy(config, MappingProxyType(keys), path)


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping: YAML keeps the last
    silently, so a second ``tenants.a`` would replace the first's keys and limits."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the mapping's own check says so
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"key {key!r} is given twice", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _read(path: Path) -> object:
    try:
        text = path.read_text(encoding="utf-8-sig")  # a BOM some editors write is fine
    except OSError as exc:
        raise TenantsFileError(path, "", f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TenantsFileError(path, "", f"must be UTF-8 text: {exc}") from None
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            return tomllib.loads(text)
        if suffix in (".yaml", ".yml"):
            return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no object tags
    except tomllib.TOMLDecodeError as exc:
        raise TenantsFileError(path, "", f"not valid TOML: {exc}") from None
    except yaml.YAMLError as exc:
        raise TenantsFileError(path, "", f"not valid YAML: {exc}") from None
    raise TenantsFileError(path, "", "must end in .toml, .yaml or .yml")


def _split_keys(path: Path, name: object, table: object, keys: dict[str, str]) -> object:
    """The policy table without its key hashes, which are added to ``keys``."""
    where = f"tenants.{name}"
    if not isinstance(name, str) or not _TENANT_RE.fullmatch(name):
        raise TenantsFileError(path, where, f"tenant names must match {TENANT_PATTERN}")
    if name.startswith(RESERVED_PREFIX):
        # <prefix>.replies.ingest-* are the ingest instances' own reply topics.
        raise TenantsFileError(path, where, f"tenant names starting {RESERVED_PREFIX!r} are "
                               "reserved")
    if not isinstance(table, Mapping):
        raise TenantsFileError(path, where, "must be a table of settings")
    digests = _digests(path, f"{where}.{KEY_FIELD}", table.get(KEY_FIELD))
    for digest in digests:
        other = keys.setdefault(digest, name)
        if other != name:
            raise TenantsFileError(
                path, f"{where}.{KEY_FIELD}", f"key hash already belongs to tenant {other!r}"
            )
    return {k: v for k, v in table.items() if k != KEY_FIELD}


def _digests(path: Path, setting: str, value: object) -> tuple[str, ...]:
    if value is None:
        raise TenantsFileError(path, setting, "required: sha256 hex digest(s) of the API key(s)")
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise TenantsFileError(path, setting, "must be a digest or a non-empty list of digests")
    for item in items:
        if not isinstance(item, str) or not _SHA256_RE.fullmatch(item):
            raise TenantsFileError(
                path, setting, "each entry must be 64 lowercase hex characters (sha256 of the "
                "key), not the key itself",
            )
    return tuple(items)
