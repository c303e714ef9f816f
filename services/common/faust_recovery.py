"""Faust's table recovery, with its end-of-recovery race closed (faust-streaming#596).

At the end of a recovery (after every rebalance, so at every start) faust resumes the
stream partitions, seeks them to their committed offsets, then clears the agents' queues
(``app.flow_control.resume()``) and resumes the flow. The consumer's flow is still active
from reading the changelogs, so records the fetcher delivers while the seek is waiting on
the broker land in the agents' queues and are then cleared. Faust has already moved its
read offset past them, so it never reads them again, and it never commits past the first
of them either: they are neither processed nor redone until the next rebalance or restart
(seen as an ingest kill -9 and restart that left a run of intake records unanswered).

:class:`TableManager` makes recovery stop the flow before the stream partitions are
resumed; faust's own code resumes it after clearing the queues, so the first record an
agent sees is the one at the committed offset (a batch fetched while the flow is stopped
is dropped by faust's ``Consumer.getmany``, which seeks back to the committed offsets).
Pass it as ``faust.App(TableManager=...)`` (``services.common.faust_app.make_app`` does).
Written against faust-streaming 0.15 (``Recovery.on_recovery_completed`` and
``_resume_streams``); ``tests/integration/test_faust_recovery.py`` fails if it stops working.
"""

from __future__ import annotations

from faust.tables import TableManager as FaustTableManager
from faust.tables.recovery import Recovery as FaustRecovery


class Recovery(FaustRecovery):
    """Faust's recovery; both ways of resuming the streams first stop the flow. (Same class
    name as faust's, so its log lines read as before.)"""

    async def on_recovery_completed(self, generation_id: int = 0) -> None:
        # Faust resumes the flow at the end, after clearing the queues (if a new rebalance
        # started meanwhile it returns early, and the next recovery resumes the flow).
        self.app.consumer.stop_flow()
        await super().on_recovery_completed(generation_id)

    async def _resume_streams(self, generation_id: int = 0) -> None:
        # The same order (resume, seek, clear, resume flow) for an app without tables.
        self.app.consumer.stop_flow()
        await super()._resume_streams(generation_id)


class TableManager(FaustTableManager):
    """Faust's table manager with :class:`Recovery` (module docstring)."""

    @property
    def recovery(self) -> FaustRecovery:
        if self._recovery is None:
            self._recovery = Recovery(self.app, self, beacon=self.beacon, loop=self.loop)
        return self._recovery
