"""``services.common.kafka.ensure_topics``'s reading of CreateTopics answers (no broker)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from aiokafka.errors import TopicAuthorizationFailedError

from services.common.kafka import (
    TopicMismatchError,
    TopicRequest,
    _check_partitions,
    _raise_topic_errors,
)


def test_create_topics_errors_are_raised_not_waited_out() -> None:
    # aiokafka returns CreateTopics' per-topic errors without raising them: a refused
    # topic only showed as a 30 s timeout waiting for it to appear (and ingest, which
    # retries timeouts, waited on it).
    assert _raise_topic_errors(
        SimpleNamespace(topic_errors=[("a", 0, None), ("b", 36, "exists")])) == {"b"}
    with pytest.raises(TopicAuthorizationFailedError, match="'c'"):
        _raise_topic_errors(SimpleNamespace(topic_errors=[("a", 0, None), ("c", 29, "")]))


def test_a_retriable_create_error_is_left_to_the_wait_for_leaders() -> None:
    # REQUEST_TIMED_OUT (7) or NOT_CONTROLLER (41): the topic may well appear; startup
    # waits for its leaders as before instead of failing.
    _raise_topic_errors(SimpleNamespace(topic_errors=[("a", 7, "slow"), ("b", 41, "moved")]))


def _described(**partitions: int) -> list[dict[str, object]]:
    return [{"topic": name.replace("_", "."), "error_code": 0,
             "partitions": [{"partition": p} for p in range(n)]}
            for name, n in partitions.items()]


def test_existing_topics_with_a_partition_count_llmq_cannot_use_are_refused() -> None:
    # An intake topic a broker auto-created with 1 partition: every record sat on another
    # partition than its tenant's, and ingest moved it there for ever.
    wanted = [TopicRequest("llmq.intake", 6, exact=True),
              TopicRequest("llmq.assignments", 16)]
    _check_partitions(wanted, _described(llmq_intake=6, llmq_assignments=32))  # at least 16
    with pytest.raises(TopicMismatchError, match=r"llmq\.intake has 1 partition\(s\), llmq "
                       r"needs 6\..*delete them"):
        _check_partitions(wanted, _described(llmq_intake=1, llmq_assignments=16))
    with pytest.raises(TopicMismatchError, match="needs at least 16"):
        _check_partitions(wanted, _described(llmq_intake=6, llmq_assignments=8))
    with pytest.raises(TopicMismatchError, match="intake has 12"):  # exact: more is wrong too
        _check_partitions(wanted, _described(llmq_intake=12, llmq_assignments=16))


async def test_a_topic_made_elsewhere_meanwhile_is_checked_like_one_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by an audit: a topic missing from the list but made by someone else before
    llmq's create (a broker creating topics on first use: one partition) answered "already
    exists", and passed as made by llmq, unchecked."""
    import services.common.kafka as kafka

    class Admin:
        def __init__(self, **_: object) -> None: ...

        async def start(self) -> None: ...

        async def close(self) -> None: ...

        async def list_topics(self) -> list[str]:
            return []

        async def create_topics(self, new: list[object]) -> object:
            return SimpleNamespace(topic_errors=[(t.name, 36, "exists") for t in new])  # type: ignore[attr-defined]

        async def describe_topics(self, names: list[str]) -> list[dict[str, object]]:
            return [{"topic": n, "error_code": 0, "partitions": [{"partition": 0,
                     "leader": 1, "error_code": 0, "replicas": [1]}]} for n in names]

    async def served(*_: object) -> None: ...

    monkeypatch.setattr(kafka, "AIOKafkaAdminClient", Admin)
    monkeypatch.setattr(kafka, "_until_served", served)
    with pytest.raises(TopicMismatchError, match=r"llmq\.intake has 1 partition"):
        await kafka.ensure_topics("x:1", [TopicRequest("llmq.intake", 6, exact=True)])
