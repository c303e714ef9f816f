"""The class heads a cycle chooses from (core.heads) and the queue's keyed heads."""

from __future__ import annotations

import pytest

from schemas.common import Lane
from services.scheduler import ClassKey, QueuedRequest
from services.scheduler.core.heads import CycleHeads
from tests.builders import MODEL, NOW, make_queue, make_request


def klass(lane: Lane = "short", rank: int = 1, model: str = MODEL) -> ClassKey:
    return (lane, rank, model, None, False)


def heads_of(*entries: tuple[ClassKey, float]) -> CycleHeads:
    """Heads in this class order, each a fresh request with the given order key."""
    return CycleHeads({k: (key, make_request()) for k, key in entries})


def best_class(heads: CycleHeads, lane: Lane = "short") -> ClassKey:
    return heads.best(lane)[0]


def test_the_smallest_order_key_then_rank_goes_first() -> None:
    heads = heads_of((klass(rank=2), 5.0), (klass(rank=1), 7.0), (klass(rank=0), 5.0))
    assert best_class(heads) == klass(rank=0)  # 5.0 ties; rank 0 before rank 2


def test_of_equals_the_class_listed_first_goes_first() -> None:
    heads = heads_of((klass(model="b"), 5.0), (klass(model="a"), 5.0))
    assert best_class(heads) == klass(model="b")


def test_each_lane_has_its_own_best() -> None:
    heads = heads_of((klass("short"), 9.0), (klass("long"), 1.0))
    assert sorted(heads.lanes()) == ["long", "short"]
    assert best_class(heads, "short") == klass("short")
    assert best_class(heads, "long") == klass("long")


def test_a_dropped_class_leaves_play_and_its_lane_empties() -> None:
    heads = heads_of((klass("short"), 1.0), (klass("long"), 2.0))
    heads.drop(klass("short"))
    assert list(heads.lanes()) == ["long"] and len(heads) == 1
    heads.drop(klass("long"))
    assert not heads and list(heads.lanes()) == []


def test_a_follower_keeps_its_class_place_and_a_put_back_class_goes_last() -> None:
    a, b, c = klass(model="a"), klass(model="b"), klass(model="c")
    heads = heads_of((a, 5.0), (b, 5.0), (c, 5.0))
    _, _, place = heads.best("short")  # a, first in class order
    follower = make_request()
    heads.put(a, 5.0, follower, place=place)  # a's next request, same order key
    assert heads.best("short")[:2] == (a, follower)  # still ahead of b and c
    heads.drop(a)
    heads.drop(b)
    heads.put(b, 5.0, make_request())  # put back after a hold ended: after c now
    assert best_class(heads) == c


def test_a_follower_with_a_later_key_falls_behind() -> None:
    a, b = klass(model="a"), klass(model="b")
    heads = heads_of((a, 1.0), (b, 2.0))
    _, _, place = heads.best("short")
    heads.put(a, 3.0, make_request(), place=place)
    assert best_class(heads) == b


@pytest.mark.parametrize("classes", [6, 60])
def test_choosing_every_class_in_turn_matches_a_scan(classes: int) -> None:
    """Drop the best one after another: the order is the sorted (key, rank, class order)."""
    entries = [(klass(rank=i % 3, model=f"m{i}"), float(i % 4)) for i in range(classes)]
    heads = heads_of(*entries)
    expected = sorted(range(classes), key=lambda i: (entries[i][1], entries[i][0][1], i))
    chosen = []
    while heads:
        chosen_class = best_class(heads)
        chosen.append(next(i for i, (k, _) in enumerate(entries) if k == chosen_class))
        heads.drop(chosen_class)
    assert chosen == expected


def test_keyed_heads_are_the_heads_with_their_order_keys_in_class_order() -> None:
    requests = [
        make_request("a", lane="long", priority="low", enqueued_at=NOW - 5),
        make_request("b", lane="short", priority="high", enqueued_at=NOW - 1),
        make_request("c", lane="short", priority="high", enqueued_at=NOW - 3),
    ]
    queue = make_queue(*requests)
    keyed = queue.keyed_heads()
    assert list(keyed) == queue.class_keys()
    for k, (key, head) in keyed.items():
        assert head is queue.head(k)
        assert key == queue.order_key(head)
        assert queue.keyed_head(k) == (key, head)
    assert {head.request_id for _, head in keyed.values()} == {"a", "c"}


def test_has_lane_work_follows_pushes_and_removals() -> None:
    queue = make_queue()
    assert not queue.has_lane_work("long", MODEL)
    request: QueuedRequest = make_request("x", lane="long")
    queue.push(request)
    assert queue.has_lane_work("long", MODEL)
    assert not queue.has_lane_work("short", MODEL) and not queue.has_lane_work("long", "other")
    queue.push(make_request("x", lane="long", attempt=1))  # a newer attempt replaces it
    assert queue.has_lane_work("long", MODEL)
    queue.cancel("x")
    assert not queue.has_lane_work("long", MODEL)
    queue.push(make_request("y", lane="long", deadline=NOW))
    queue.expire(NOW)
    assert not queue.has_lane_work("long", MODEL)
