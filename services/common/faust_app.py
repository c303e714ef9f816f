"""One way to build and run a Faust app for every llmq service.

Settings that matter on a single dev broker and in tests (documented, not magic):

- ``broker_session_timeout=10 s`` / ``broker_heartbeat_interval=1 s``: a crashed member is
  noticed in ~10 s instead of faust's 60 s default, and group joins are not held up by the
  broker waiting out a dead member. (The broker runs with
  ``group.initial.rebalance.delay.ms=0`` too.)
- ``web_enabled=False``: faust's own aiohttp server is off; services that serve HTTP
  (ingest, metrics) bind their own servers to 127.0.0.1. Nothing listens beyond loopback.
- ``store="memory://"``: tables live in memory and are rebuilt from their changelog topics
  at start, so what a table holds (token buckets, concurrency) survives a restart.
- ``topic_allow_declare=True``: topics are declared by the app that owns them (idempotent).
- ``TableManager``: faust's, with the end-of-recovery race closed (records fetched while
  recovery seeks the streams were cleared from the agents' queues and never processed):
  see :mod:`services.common.faust_recovery`.
- An idempotent producer (``acks=all`` + ``enable_idempotence``, DESIGN.md's delivery
  rule): faust turns idempotence on only inside transactions, so a send it retried after
  a lost ack could be written twice. Here the broker drops such a duplicate.
- Table writes durable before the offsets of the records that made them are committed:
  faust flushes its producer before it commits, but that flush gives up on its buffer of
  table writes (``send_soon``) after 0.1 s with writes still in it, so a crash then lost a
  reservation or a bucket whose record was never read again. The producer here also waits
  for every table write handed to it until the broker acknowledged it.
- A producer that can no longer send, or a record to llmq's own topics that fails to get
  through (:func:`must_deliver`), ends the process at once (exit status 1, no graceful
  stop, nothing committed), so a supervisor restarts it with a new producer:
  :class:`services.common.kafka.Producer` and :func:`services.common.kafka.exit_now`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import faust
from faust.transport.drivers.aiokafka import Producer
from faust.types import FutureMessage, ProducerT

from services.common.faust_recovery import TableManager
from services.common.kafka import MAX_RECORD_BYTES, ProducerFailed, TopicRequest, exit_now
from services.common.kafka import Producer as LlmqProducer
from services.common.settings import Settings


def make_app(name: str, settings: Settings, **overrides: Any) -> faust.App:
    """A Faust app wired to ``settings``' broker, with the options above."""
    options: dict[str, Any] = {
        "broker": f"kafka://{settings.bootstrap}",
        "store": "memory://",
        "web_enabled": False,
        "web_bind": "127.0.0.1",
        "web_host": "127.0.0.1",
        "topic_replication_factor": settings.replication_factor,
        "topic_allow_declare": True,
        "broker_session_timeout": 10.0,
        "broker_heartbeat_interval": 1.0,
        "broker_commit_every": 100,
        "broker_commit_interval": 0.5,
        "consumer_auto_offset_reset": "earliest",
        "producer_acks": -1,
        "producer_max_request_size": MAX_RECORD_BYTES,
        "consumer_max_fetch_size": MAX_RECORD_BYTES,
        "producer_linger": 0.002,
        "datadir": str(settings.home / "faust" / name),
        "table_cleanup_interval": 30.0,
        "TableManager": TableManager,
    }
    options.update(overrides)
    Path(options["datadir"]).parent.mkdir(parents=True, exist_ok=True)
    app = _App(f"{settings.topic_prefix}-{name}", **options)
    app.llmq_prefix = settings.topic_prefix
    return app


def must_deliver(prefix: str, app_id: str) -> Callable[[str], bool]:
    """llmq's own topics and the app's internal ones (its tables' changelogs, the settle
    topic): a record to one of them that fails to get through is not committed past (see
    :class:`services.common.kafka.Producer`). Not reply topics: one tenant's topic refused
    (an ACL, a name taken) must not stop the service for everyone, so its record is lost
    and logged, as before."""
    own, replies, internal = f"{prefix}.", f"{prefix}.replies.", f"{app_id}-"
    return lambda topic: (topic.startswith(internal)
                          or (topic.startswith(own) and not topic.startswith(replies)))


#: How often the flush before a commit looks at its table writes; it waits for them in all
#: a minute longer than the producer's own request timeout (faust's
#: ``producer_request_timeout``): a write still unacknowledged then will not be.
_TABLE_WRITE_POLL_S = 1.0


class _IdempotentProducer(Producer):
    """Faust's aiokafka producer, idempotent outside transactions too, whose ``flush``
    (before each commit) waits for the table writes too (module docstring)."""

    def send_soon(self, fut: FutureMessage) -> None:
        """A table write (faust's changelog sends): kept until the broker acknowledged it
        (the future resolves then, or fails, and a failed write to a changelog ends the
        process: :func:`must_deliver`)."""
        soon: set[FutureMessage] = self.__dict__.setdefault("_llmq_soon", set())
        soon.add(fut)
        fut.add_done_callback(soon.discard)
        super().send_soon(fut)

    async def flush(self) -> None:
        # The writes made so far: those of the records whose offsets are about to be
        # committed (writes made meanwhile are later records', for a later commit).
        owed = {f for f in self.__dict__.get("_llmq_soon", ()) if not f.done()}
        await super().flush()
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + float(self.app.conf.producer_request_timeout) + 60.0
        while owed:
            _, pending = await asyncio.wait(owed, timeout=_TABLE_WRITE_POLL_S)
            owed = pending
            # A write whose send raised dies with faust's buffer task (it is never resolved),
            # and one the broker never takes waits for good: both end the process, nothing
            # committed, rather than a commit (or a stop) that waits for ever.
            if owed and (self.buffer.state != "running" or loop.time() >= deadline):
                exit_now(ProducerFailed(
                    f"{len(owed)} table write(s) not acknowledged after "
                    f"{loop.time() - started:.0f} s (faust's producer buffer: "
                    f"{self.buffer.state})"))
                return  # (exit_now does not return; a test's stand-in may)

    def _settings_extra(self) -> Mapping[str, Any]:
        return {**super()._settings_extra(), "acks": "all", "enable_idempotence": True}

    def _new_producer(self, transactional_id: str | None = None) -> LlmqProducer:
        app = self.app
        return LlmqProducer(
            on_failure=self._failed, transactional_id=transactional_id,
            must_deliver=must_deliver(getattr(app, "llmq_prefix", "llmq"), app.conf.id),
            **{**self._settings_default(), **self._settings_auth(), **self._settings_extra()})

    def _failed(self, exc: ProducerFailed) -> None:
        exit_now(exc)  # not app.crash: its graceful stop would commit (see exit_now)


class _App(faust.App):
    #: LLMQ_TOPIC_PREFIX of the app's topics (set by :func:`make_app`).
    llmq_prefix = "llmq"

    def _new_producer(self) -> ProducerT:
        return _IdempotentProducer(self.transport, loop=self.loop, beacon=self.beacon)


def run_app(app: faust.App, loglevel: str = "info") -> None:
    """Run ``app`` in this process until SIGINT/SIGTERM, without faust's web server."""
    worker = faust.Worker(app, loglevel=loglevel, redirect_stdouts=False)
    logging.getLogger("faust").setLevel(loglevel.upper())
    worker.execute_from_commandline()


def leader_topic(app_id: str) -> TopicRequest:
    """Faust's leader-assignor topic of app ``app_id`` (Faust's own name and size for it).

    Services create it with their other topics, before Faust starts: created by Faust the
    instant its consumer subscribes, it can be missing from that consumer's first metadata,
    and the app then runs without the leader partition (``is_leader()`` False) until the
    next metadata refresh.
    """
    return TopicRequest(f"{app_id}-__assignor-__leader", 1)

