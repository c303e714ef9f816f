"""Depth and lag arithmetic, and how the owning consumer group is picked (pure)."""

from __future__ import annotations

import pytest
from aiokafka import TopicPartition

from services.health.lag import (
    Span,
    partition_lag,
    pick_group,
    slot_figures,
    topic_figures,
    topic_role,
)

REQ = "p.requests.high.short"
REQ2 = "p.requests.low.long"


def tp(topic: str, partition: int) -> TopicPartition:
    return TopicPartition(topic, partition)


@pytest.mark.parametrize(
    ("span", "committed", "lag"),
    [
        (Span(0, 10), None, 10),   # no commit: the group would start at the beginning
        (Span(0, 10), 4, 6),
        (Span(0, 10), 10, 0),
        (Span(5, 10), 2, 5),       # committed below retention: only retained records count
        (Span(0, 10), 12, 0),      # never negative
        (Span(0, 0), None, 0),
    ],
)
def test_partition_lag(span: Span, committed: int | None, lag: int) -> None:
    assert partition_lag(span, committed) == lag


@pytest.mark.parametrize(
    ("commits", "topics", "hint", "group"),
    [
        ({}, [REQ], "scheduler", None),
        ({"g": {tp("other", 0): 5}}, [REQ], "scheduler", None),
        ({"g": {tp(REQ, 0): 5}}, [REQ], "scheduler", "g"),
        # the name hint wins over progress
        ({"p-scheduler": {tp(REQ, 0): 1}, "p-x": {tp(REQ, 0): 9}}, [REQ], "scheduler",
         "p-scheduler"),
        # without a hint match, the group that consumed most
        ({"a": {tp(REQ, 0): 1}, "b": {tp(REQ2, 0): 9}}, [REQ, REQ2], "scheduler", "b"),
        # a tie goes to the first name
        ({"b": {tp(REQ, 0): 3}, "a": {tp(REQ, 0): 3}}, [REQ], "", "a"),
    ],
)
def test_pick_group(commits: dict[str, dict[TopicPartition, int]], topics: list[str],
                    hint: str, group: str | None) -> None:
    assert pick_group(commits, topics, hint) == group


def test_topic_figures_sum_partitions() -> None:
    spans = {tp(REQ, 0): Span(0, 6), tp(REQ, 1): Span(2, 6), tp(REQ2, 0): Span(0, 100)}
    commits = {"g": {tp(REQ, 0): 4}}
    fig = topic_figures(REQ, "requests", spans, "g", commits)
    assert (fig.partitions, fig.depth, fig.end, fig.lag) == (2, 10, 12, 2 + 4)
    no_group = topic_figures(REQ, "requests", spans, None, commits)
    assert no_group.lag is None and no_group.depth == 10
    unknown = topic_figures(REQ, "requests", spans, "nobody", commits)
    assert unknown.lag == 10


def test_slot_figures_per_partition_owner() -> None:
    topic = "p.assignments"
    spans = {tp(topic, p): Span(0, 5) for p in range(3)}
    commits = {"p-worker-slot-0": {tp(topic, 0): 5}, "p-worker-slot-2": {tp(topic, 2): 1}}
    fig = slot_figures(topic, spans, commits)
    assert [(s.partition, s.group, s.lag) for s in fig.slots] == [
        (0, "p-worker-slot-0", 0), (2, "p-worker-slot-2", 4)]
    assert (fig.depth, fig.lag, fig.group) == (15, 4, None)
    assert slot_figures(topic, spans, {}).lag is None


@pytest.mark.parametrize(
    ("topic", "role"),
    [("p.intake", "intake"), ("p.requests.high.short", "requests"),
     ("p.assignments", "assignments"), ("a.b.heartbeats", "heartbeats")],
)
def test_topic_role(topic: str, role: str) -> None:
    prefix = "a.b" if topic.startswith("a.b.") else "p"
    assert topic_role(prefix, topic) == role
