"""``services.common.kafka.ensure_topics``'s reading of CreateTopics answers (no broker)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from aiokafka.errors import TopicAuthorizationFailedError

from services.common.kafka import _raise_topic_errors


def test_create_topics_errors_are_raised_not_waited_out() -> None:
    # aiokafka returns CreateTopics' per-topic errors without raising them: a refused
    # topic only showed as a 30 s timeout waiting for it to appear (and ingest, which
    # retries timeouts, waited on it).
    _raise_topic_errors(SimpleNamespace(topic_errors=[("a", 0, None), ("b", 36, "exists")]))
    with pytest.raises(TopicAuthorizationFailedError, match="'c'"):
        _raise_topic_errors(SimpleNamespace(topic_errors=[("a", 0, None), ("c", 29, "")]))


def test_a_retriable_create_error_is_left_to_the_wait_for_leaders() -> None:
    # REQUEST_TIMED_OUT (7) or NOT_CONTROLLER (41): the topic may well appear; startup
    # waits for its leaders as before instead of failing.
    _raise_topic_errors(SimpleNamespace(topic_errors=[("a", 7, "slow"), ("b", 41, "moved")]))
