"""The extension points of placement: one small Protocol each, and what they may read.

Placement runs filters → scorers → picker over the workers of the request's route, like
llm-d's endpoint picker. Every plugin is stateless and pure; what it needs to know about
load comes from the :class:`PlacementContext` (the frozen snapshot and the ledger).

* :class:`Filter` — may this worker take this request? Hard constraints, in three stages:

  - ``"route"``: reads only the worker, the snapshot and the request's route fields
    (model, model_version, lane); its verdict is computed once per snapshot and route.
  - ``"index"``: exactly the capacity rule the core's candidate index enforces — a worker
    is a candidate only while ``ledger.room(worker) >= request.kv_tokens``, which holds
    precisely when both ``kv-fits`` and ``seq-slots`` accept. Only those two filters may
    claim this stage (the pipeline checks); their ``accepts`` states the rule for tests and
    tools but is not called per candidate, which keeps a decision within its budget.
  - ``"room"``: may read the ledger; asked about the candidates of every decision, a
    batch at a time (:class:`RoomFilter`).
* :class:`Scorer` — how good is each candidate for this request, in [0, 1] (1 best)? The
  pipeline combines scorers as a weighted mean. A scorer rates the whole candidate list in
  one call (as llm-d's scorers do): one Python call per scorer instead of one per worker
  keeps a decision within its microsecond budget.
* :class:`Picker` — choose one of the scored candidates; randomness only from ``rng``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, Protocol, runtime_checkable

from schemas.common import priority_rank
from services.scheduler.core.index import max_tokens_per_s
from services.scheduler.core.ledger import Ledger
from services.scheduler.core.types import QueuedRequest, Snapshot, WorkerState

Stage = Literal["route", "index", "room"]

#: A candidate with its combined score.
Scored = tuple[float, WorkerState]

#: Plugin parameters as they appear in the profile (``params.<plugin-name>``).
Params = Mapping[str, object]


class PlacementContext:
    """What plugins may read during one ``schedule()`` call."""

    __slots__ = ("_aged", "_max_tps", "_ranked", "ledger", "now", "route", "snapshot")

    def __init__(
        self,
        snapshot: Snapshot,
        ledger: Ledger,
        now: float,
        aged: Callable[[QueuedRequest, float], int] | None = None,
    ) -> None:
        self.snapshot = snapshot
        self.ledger = ledger
        self.now = now
        self._aged = aged
        self._max_tps: float | None = None
        #: The last request :meth:`class_rank` ranked, and its rank: room filters ask once
        #: per batch of candidates, several per decision, and ``now`` does not move within
        #: the cycle.
        self._ranked: tuple[QueuedRequest | None, int] = (None, 0)
        #: The (model, version, lane) of the request being placed, set by the cycle before
        #: its picker runs (None outside a cycle: pickers then use fleet-wide state).
        self.route: tuple[str, str | None, str] | None = None

    def class_rank(self, request: QueuedRequest) -> int:
        """The class ``request`` has aged into by ``now`` (0 high, 1 normal, 2 low): the
        pending queue's ``engine_priority`` when the cycle passes it (``aged``), else the
        request's own class."""
        if self._aged is None:
            return priority_rank(request.priority)
        last, rank = self._ranked
        if last is not request:
            rank = self._aged(request, self.now)
            self._ranked = (request, rank)
        return rank

    @property
    def max_tokens_per_s(self) -> float:
        """Best recent throughput among fresh workers (0 for an empty fleet)."""
        if self._max_tps is None:
            self._max_tps = max_tokens_per_s(self.snapshot)
        return self._max_tps


@runtime_checkable
class Filter(Protocol):
    """A hard constraint: True when ``worker`` may take ``request``."""

    @property
    def name(self) -> str: ...

    @property
    def stage(self) -> Stage: ...

    def accepts(
        self, worker: WorkerState, request: QueuedRequest, ctx: PlacementContext
    ) -> bool: ...


@runtime_checkable
class RoomFilter(Filter, Protocol):
    """A ``room``-stage filter, which the cycle asks about a batch of candidates at once.

    ``accepts_each`` gives the verdicts ``accepts`` would give, one per worker in order,
    in one Python call per batch instead of one per worker (as scorers do), with the
    per-request work done once: every decision asks about its K candidates.
    """

    def accepts_each(
        self, workers: Sequence[WorkerState], request: QueuedRequest, ctx: PlacementContext
    ) -> list[bool]:
        """One verdict per worker, in the same order; equal to ``accepts`` for each."""
        ...


@runtime_checkable
class Scorer(Protocol):
    """A preference in [0, 1] for each candidate; 1 is the best worker for the request."""

    @property
    def name(self) -> str: ...

    def scores(
        self, workers: Sequence[WorkerState], request: QueuedRequest, ctx: PlacementContext
    ) -> list[float]:
        """One score per worker, in the same order."""
        ...


@runtime_checkable
class Picker(Protocol):
    """Chooses one candidate. ``uses_scores`` False lets the pipeline skip scoring."""

    @property
    def name(self) -> str: ...

    @property
    def uses_scores(self) -> bool: ...

    def pick(
        self, candidates: Sequence[Scored], rng: random.Random, ctx: PlacementContext
    ) -> WorkerState:
        """``candidates`` is never empty."""
        ...


Plugin = Filter | Scorer | Picker
