"""Errors of the operator commands; the CLI prints them and exits 1."""

from __future__ import annotations


class OpsError(Exception):
    """An operator command could not do what was asked (message is for the operator)."""


class KafkaUnavailable(OpsError):
    """No broker answered at the configured bootstrap address."""


class UnknownWorker(OpsError):
    """No heartbeat of this worker was ever read."""
