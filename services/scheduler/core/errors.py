"""Errors raised by the scheduling core."""

from __future__ import annotations


class ConfigError(ValueError):
    """A scheduler setting is unknown, missing or out of bounds.

    ``setting`` is the dotted path of the offending setting as it appears in the profile or
    config file (``scorers.kv-headroom``, ``filters[3]``, ``params.max-score.tie_epsilon``,
    ``queue.aging_s_per_class``), so an operator can find it without reading code. Raised
    when the config is built, never on the hot path.
    """

    def __init__(self, setting: str, problem: str) -> None:
        super().__init__(f"{setting}: {problem}")
        self.setting = setting
        self.problem = problem
