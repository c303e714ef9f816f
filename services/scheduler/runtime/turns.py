"""Which turn is this replica's: from the scheduler consumer group's live members.

Replicas place in turns on each worker (``policies.filters.replica_turn``), numbered
``0..replicas-1``. Unless set (``LLMQ_SCHEDULER_REPLICAS``), the numbers come from the
consumer group every replica is a member of: its members' client ids (each replica's
``scheduler_id``) in sorted order. Every replica reads the same list from the group
coordinator, so they agree on the numbering, and it follows replicas that join or leave
(at the rebalance that their joining or leaving causes). Plain values, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence


def turns_of(members: Sequence[str], me: str) -> tuple[int, int] | None:
    """(replicas, this replica's index) from the group's member client ids; None while
    ``me`` is not among them (joining, or a rebalance under way). Replicas sharing an id
    count once, and would share its turns: :func:`shared` tells the caller to say so."""
    ids = sorted(set(members))
    if me not in ids:
        return None
    return len(ids), ids.index(me)


def shared(members: Sequence[str]) -> list[str]:
    """Client ids more than one member uses (replicas given the same scheduler_id)."""
    return sorted({m for m in members if members.count(m) > 1})
