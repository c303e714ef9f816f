"""Errors raised by the ingest core."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting is missing or out of bounds.

    ``setting`` is the dotted path of the offending setting as it appears in the config
    file (``models.foo.num_kv_heads``, ``tenants.acme.rpm``, ``lanes.threshold``), so an
    operator can find it without reading code. Raised at startup, never on the hot path.
    """

    def __init__(self, setting: str, problem: str) -> None:
        super().__init__(f"{setting}: {problem}")
        self.setting = setting
        self.problem = problem
