"""The scheduler's runtime: plain state-owning classes between Faust and the pure core.

Who owns what (one owner each, driven from the service's single event loop):

- :mod:`.state` — :class:`SchedulerState`: the pending queue, the ledger and everything
  that feeds them; calls the core (``schedule``, ``requeue_lost``) and returns effects;
- :mod:`.results` — what it is given and gives back: :class:`RuntimeConfig`,
  :class:`Effect`, :class:`TickResult`, :class:`HeldRequeue`, the span recorder;
- :mod:`.fleet` — :class:`FleetView`: newest heartbeat per worker, liveness (stale = dead);
- :mod:`.log` — :class:`AssignmentLog`: assignments and lifecycle events per request, the
  replayable memory the ledger is rebuilt from after a restart;
- :mod:`.meters` — :class:`RecentCancels` (cancels that arrived before their request);
- :mod:`.flow` — :class:`OrderedAcks` (acks in offset order), :class:`PauseLadder`
  (which request topics to pause as the queue fills);
- :mod:`.messages` — translations between wire messages and the core's values;
- :mod:`.outbox` — :class:`Outbox`: batched sends, acks once durable, retries;
- :mod:`.topics` — the topic names; :mod:`.metrics` — Prometheus metrics.

Heartbeats, assignments and events are read from the beginning by
:class:`services.common.log_reader.LogReader` (the GlobalTable equivalent, shared with
ingest). Everything here but ``metrics`` and ``topics`` imports no Kafka client; the state
classes are I/O-free and tested synchronously (the outbox with a fake send). The Faust
wiring is ``services.scheduler.app``.
"""
