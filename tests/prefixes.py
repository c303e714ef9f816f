"""Topic prefixes made by this test session.

Every test that creates topics names them under a prefix from :func:`unique_prefix` (the
``topic_prefix`` fixture, the live stacks). At its end the session deletes the topics
under these prefixes that it created — and nothing else, so two sessions sharing a
broker (a developer's run beside ``make test``) never delete each other's topics.
"""

from __future__ import annotations

import uuid

SESSION_PREFIXES: set[str] = set()


def unique_prefix(letter: str) -> str:
    """``letter`` + 10 hex digits, remembered for the session's cleanup."""
    prefix = f"{letter}{uuid.uuid4().hex[:10]}"
    SESSION_PREFIXES.add(prefix)
    return prefix


def is_ours(topic: str) -> bool:
    """Whether ``topic`` lies under one of this session's prefixes (``p.`` or Faust's
    ``p-app-...`` internal topics)."""
    return any(topic.startswith((p + ".", p + "-")) for p in SESSION_PREFIXES)
