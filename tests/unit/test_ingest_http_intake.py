"""IntakeHandler (what the Faust agents run) with dicts for tables and a list for the producer.

Every request — HTTP or Kafka client — goes through this: decode, core ``admit()``, store,
publish exactly one outcome; settle on terminal events; expire lost reservations.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError, TopicAuthorizationFailedError

from schemas.codec import SchemaError, decode, encode
from schemas.messages import REPLY_ADAPTER, REQUEST_ADAPTER
from schemas.replies import Error, Usage
from schemas.requests import InferenceRequest
from schemas.workers import EventDone, EventStarted
from services.ingest.cluster import ClusterTracker, Freshness
from services.ingest.core import ClusterView, TenantState
from services.ingest.intake import IntakeHandler, SettleRecord
from services.ingest.tenants import Tenancy, hash_api_key, load_tenancy, parse_tenants
from services.ingest.topics import IngestTopics
from tests.builders_schemas import make_heartbeat, make_prompt_request

NOW = 10_000.0
MODEL = "smollm2-135m"
TOPICS = IngestTopics.of("llmq", "llmq-ingest", "a")
KEYED = {"tenants": {"acme": {
    "api_key_sha256": hash_api_key("k"), "rpm": 60, "request_burst": 1, "tpm": 100_000,
    "max_concurrency": 4,
}}}


@dataclass
class Record:
    value: Any
    key: Any
    topic: str = TOPICS.intake
    partition: int = 0
    timestamp: float | None = None  # faust's Message.timestamp (seconds)
    offset: int | None = None


class Harness:
    def __init__(
        self, tenancy: Tenancy, tracker: ClusterTracker | None = None,
        owner_partition: Callable[[bytes], int] | None = None,
        existing: set[str] | None = None,
        answered_before: set[str] | None = None,
    ) -> None:
        self.asked_before: list[tuple[int, int, str]] = []
        self.answered_before = answered_before
        self.sent: list[tuple[str, bytes, bytes]] = []
        self.stamps: list[float | None] = []  # the timestamp each was published with
        self.headers: list[dict[str, bytes]] = []  # the headers each was published with
        self.ensured: list[str] = []
        self.buckets: dict[str, Any] = {}
        self.reservations: dict[str, Any] = {}
        self.now = NOW
        if tracker is None:
            tracker = ClusterTracker(tenancy.config.admission.registry, Freshness())
            tracker.observe_heartbeat(make_heartbeat(worker_id="w", model=MODEL, ts=NOW))
        self.handler = IntakeHandler(
            topics=TOPICS, tenancy=tenancy, tracker=tracker, buckets=self.buckets,
            reservations=self.reservations, publish=self._publish, ensure_topic=self._ensure,
            clock=lambda: self.now, reservation_grace_s=30.0, owner_partition=owner_partition,
            topic_exists=None if existing is None else self._exists,
            answered_before=None if answered_before is None else self._answered,
        )
        self.existing = existing or set()
        self.checked: list[str] = []

    async def _publish(self, topic: str, key: bytes, value: bytes,
                       headers: list[tuple[str, bytes]] | None = None,
                       timestamp: float | None = None) -> None:
        self.sent.append((topic, key, value))
        self.stamps.append(timestamp)
        self.headers.append(dict(headers or []))

    async def _answered(self, partition: int, offset: int, request_id: str) -> bool:
        self.asked_before.append((partition, offset, request_id))
        return request_id in (self.answered_before or ())

    async def _ensure(self, topic: str) -> None:
        self.ensured.append(topic)

    async def _exists(self, topic: str) -> bool:
        self.checked.append(topic)
        return topic in self.existing

    async def submit(self, req: InferenceRequest, key: bytes | None = None,
                     offset: int | None = 7) -> None:
        raw = encode(req)
        await self.handler.on_request(Record(raw, req.tenant.encode() if key is None else key,
                                             offset=offset))

    def replies(self) -> list[Error]:
        out = []
        for topic, _, value in self.sent:
            if ".replies." in topic:
                msg = decode(value, REPLY_ADAPTER)
                assert isinstance(msg, Error)
                out.append(msg)
        return out


def request(rid: str = "r1", tenant: str = "default", **changes: Any) -> InferenceRequest:
    fields: dict[str, Any] = {
        "request_id": rid, "tenant": tenant, "model": MODEL, "max_tokens": 10,
        "priority": "normal", "reply_to": None, "timeout_s": 60.0, "created_at": NOW,
    }
    fields.update(changes)
    return make_prompt_request("x" * 40, **fields)


async def test_admitted_request_is_stored_and_published() -> None:
    h = Harness(load_tenancy(None))
    await h.submit(request("cmpl-r1", reply_to="llmq.replies.ingest-a"))
    [(topic, key, value)] = h.sent
    assert (topic, key) == ("llmq.requests.normal.short", b"cmpl-r1")
    admitted = decode(value, REQUEST_ADAPTER)
    assert admitted.reply_topic == "llmq.replies.ingest-a"
    assert admitted.prompt_tokens == 10 and admitted.admitted_at == NOW
    state = TenantState.from_dict(h.buckets["default"])
    assert state.in_flight == 1
    assert h.reservations["cmpl-r1"] == {"tenant": "default", "reserved": 20,
                                         "reply_topic": "llmq.replies.ingest-a",
                                         "deadline": NOW + 60.0 + 30.0, "admitted_at": NOW,
                                         "priority": "normal", "lane": "short",
                                         "prompt_tokens": 10,
                                         "digest": hashlib.sha256(encode(request(
                                             "cmpl-r1", reply_to="llmq.replies.ingest-a"
                                         ))).hexdigest()}


async def test_kafka_clients_get_their_tenant_reply_topic() -> None:
    h = Harness(load_tenancy(None))
    await h.submit(request(tenant="team-a"))
    assert decode(h.sent[0][2], REQUEST_ADAPTER).reply_topic == "llmq.replies.team-a"


async def test_rejection_is_one_terminal_error_and_costs_nothing() -> None:
    h = Harness(parse_tenants(Path("t.toml"), KEYED))
    await h.submit(request("r1", "acme"))
    before = dict(h.buckets["acme"])
    await h.submit(request("r2", "acme"))  # request_burst 1: refused
    [refusal] = h.replies()
    assert (refusal.request_id, refusal.code, refusal.attempt) == ("r2", "rate_limited", 0)
    assert refusal.retry_after_s is not None and refusal.retry_after_s > 0
    assert [t for t, _, _ in h.sent] == ["llmq.requests.normal.short", "llmq.replies.acme"]
    assert h.buckets["acme"] == before and "r2" not in h.reservations
    assert h.ensured == ["llmq.replies.acme"]  # the tenant's reply topic made sure of, once


async def test_record_keyed_by_anything_but_its_tenant_is_rekeyed() -> None:
    h = Harness(load_tenancy(None))
    req = request()
    await h.submit(req, key=b"r1")
    assert h.sent == [(TOPICS.intake, b"default", encode(req))]
    assert h.buckets == {} and h.reservations == {}


async def test_record_on_another_partition_than_its_tenant_is_moved() -> None:
    # A client library whose default partitioner is not murmur2 (librdkafka's is CRC32).
    h = Harness(load_tenancy(None), owner_partition=lambda key: 3)
    req = request()
    await h.handler.on_request(Record(encode(req), b"default", partition=1, timestamp=NOW - 5))
    assert h.sent == [(TOPICS.intake, b"default", encode(req))]
    # With the time it was produced: "deadline long past" is judged against it (a review:
    # moved with the time of the move, a record read late was refused as if sent late).
    assert h.stamps == [NOW - 5]
    await h.handler.on_request(Record(encode(req), b"default", partition=3))
    assert [t for t, _, _ in h.sent][-1] == "llmq.requests.normal.short"


async def test_a_redelivered_request_in_flight_is_not_admitted_twice_but_sent_again() -> None:
    # Its reservation and its admitted request are two writes on two partitions: ingest
    # stopping between them left a reservation whose request never reached the scheduler,
    # and every redelivery was dropped as a duplicate: no terminal, ever. The admission is
    # sent again as it was (the scheduler takes a copy it has for a redelivery), and the
    # tenant is charged once.
    h = Harness(load_tenancy(None))
    await h.submit(request())
    h.now += 5.0
    await h.submit(request())
    (t1, k1, first), (t2, k2, again) = h.sent
    assert (t1, k1) == (t2, k2) == ("llmq.requests.normal.short", b"r1")
    assert decode(again, REQUEST_ADAPTER) == decode(first, REQUEST_ADAPTER)  # admitted_at too
    assert TenantState.from_dict(h.buckets["default"]).in_flight == 1


async def test_the_same_caller_reusing_an_id_in_flight_for_another_body_is_dead_lettered(
) -> None:
    """Found by an audit: it was taken for a redelivery, and the held admission was sent
    again with the new body (max_tokens 5,000 on a reservation of 10, its checks skipped).
    Now nothing is published for it and nothing is answered under that id (the first
    request's listeners would take it as the first one's end); the guard dead-letters it."""
    h = Harness(load_tenancy(None))
    await h.submit(request("r1", max_tokens=10))
    with pytest.raises(SchemaError) as err:
        await h.submit(request("r1", max_tokens=5000))
    assert [e.field for e in err.value.errors] == ["request_id"]
    assert "in flight for another request from the same caller" in str(err.value)
    [(topic, _, value)] = h.sent  # only the first one's admission
    assert topic == "llmq.requests.normal.short"
    assert decode(value, REQUEST_ADAPTER).request.max_tokens == 10
    assert TenantState.from_dict(h.buckets["default"]).in_flight == 1
    # A reservation written before the digest was kept: a redelivery, as before.
    del h.reservations["r1"]["digest"]
    await h.submit(request("r1", max_tokens=10))
    assert len(h.sent) == 2 and h.sent[1] == h.sent[0]


async def test_a_reservation_whose_request_never_landed_is_completed_by_the_redelivery() -> None:
    h = Harness(load_tenancy(None))
    await h.submit(request())
    h.sent.clear()  # the admitted request was lost; the table kept the reservation
    await h.submit(request())
    [(topic, _, value)] = h.sent
    admitted = decode(value, REQUEST_ADAPTER)
    assert topic == "llmq.requests.normal.short" and admitted.admitted_at == NOW


@pytest.mark.parametrize("other", [
    {"tenant": "team-b"},  # another tenant chose the same id
    {"reply_to": "llmq.replies.ingest-b"},  # a retry through another ingest instance
    # Another tenant's, naming the instance topic the holder's answer streams to: the
    # refusal, keyed by the id, would reach the holder's call there instead.
    {"tenant": "team-b", "reply_to": "llmq.replies.ingest-b", "expect": "llmq.replies.team-b",
     "holder_reply_to": "llmq.replies.ingest-b"},
    # ... but where the holder does not listen, where the requester asked.
    {"tenant": "team-b", "reply_to": "llmq.replies.ingest-b"},
])
async def test_the_id_of_a_request_in_flight_used_by_another_caller_is_refused(
    other: dict[str, Any],
) -> None:
    h = Harness(load_tenancy(None))
    other = dict(other)
    holder_reply_to = other.pop("holder_reply_to", None)
    await h.submit(request("cmpl-job-1", tenant="team-a", reply_to=holder_reply_to))
    expect = other.pop("expect", other.get("reply_to", "llmq.replies.team-b"))
    tenant = other.get("tenant", "team-a")
    await h.submit(request("cmpl-job-1", **{"tenant": tenant, **other}))
    # The first is admitted; the second gets one terminal answer, on its own reply topic.
    assert h.sent[0][0] == "llmq.requests.normal.short"
    [(topic, _, value)] = h.sent[1:]
    refusal = decode(value, REPLY_ADAPTER)
    assert isinstance(refusal, Error) and (refusal.request_id, refusal.code) == (
        "cmpl-job-1", "invalid")
    assert "request ids must be unique" in refusal.message
    assert topic == expect
    assert h.reservations["cmpl-job-1"]["tenant"] == "team-a"  # the first one's is untouched


async def test_a_created_at_far_ahead_of_ingests_clock_is_refused() -> None:
    h = Harness(load_tenancy(None))
    await h.submit(request("r1", created_at=NOW + 10 * 86_400))
    [refusal] = h.replies()
    assert refusal.code == "invalid" and "check the client's clock" in refusal.message
    assert "r1" not in h.reservations


async def test_a_reservation_outlives_its_requests_deadline() -> None:
    # Within the allowed skew, created_at ahead of ingest's clock moves the deadline.
    h = Harness(load_tenancy(None))
    await h.submit(request("r1", created_at=NOW + 200.0, timeout_s=60.0))
    assert h.reservations["r1"]["deadline"] == NOW + 200.0 + 60.0 + 30.0


async def test_undecodable_request_is_refused_when_someone_waits_then_raised() -> None:
    h = Harness(load_tenancy(None))
    bad = encode(request(tenant="acme")).replace(b'"max_tokens":10', b'"max_tokens":0')
    with pytest.raises(SchemaError):
        await h.handler.on_request(Record(bad, b"acme"))
    [refusal] = h.replies()
    assert (refusal.request_id, refusal.code) == ("r1", "invalid")
    assert "max_tokens" in refusal.message
    with pytest.raises(SchemaError):
        await h.handler.on_request(Record(b"\x00garbage", b"acme"))
    assert len(h.sent) == 1  # nobody to tell about pure garbage: the dead letter has it


async def test_an_undecodable_record_never_answers_on_an_ingest_instances_topic() -> None:
    # An HTTP caller waits there for its id: a broken record naming that id and topic
    # would end the caller's call with the record's error. Its answer goes to its tenant.
    h = Harness(load_tenancy(None))
    bad = encode(request("job-1", tenant="acme", reply_to="llmq.replies.ingest-a")).replace(
        b'"max_tokens":10', b'"max_tokens":0')
    with pytest.raises(SchemaError):
        await h.handler.on_request(Record(bad, b"acme"))
    assert [t for t, _, _ in h.sent] == ["llmq.replies.acme"]
    assert [(e.request_id, e.code) for e in h.replies()] == [("job-1", "invalid")]


async def test_a_broken_copy_of_a_request_in_flight_is_not_answered() -> None:
    # Its holder's terminal is still to come: a refusal under its id would be a second.
    h = Harness(load_tenancy(None))
    await h.submit(request("r1", tenant="acme"))
    bad = encode(request("r1", tenant="acme")).replace(b'"max_tokens":10', b'"max_tokens":0')
    with pytest.raises(SchemaError):  # the guard dead-letters it
        await h.handler.on_request(Record(bad, b"acme"))
    assert h.replies() == [] and len(h.sent) == 1  # the admitted request only


async def test_another_tenants_id_may_not_be_answered_on_an_ingest_instances_topic() -> None:
    # HTTP calls wait there by id alone, and an x-request-id is scoped "<tenant>:<id>":
    # acme naming "victim:42" there would have its answer stream into victim's call.
    h = Harness(parse_tenants(Path("t.toml"), KEYED), existing={"llmq.replies.ingest-a"})
    await h.submit(request("victim:42", "acme", reply_to="llmq.replies.ingest-a"))
    [(topic, _, value)] = h.sent
    refusal = decode(value, REPLY_ADAPTER)
    assert topic == "llmq.replies.acme" and isinstance(refusal, Error)
    assert refusal.code == "invalid" and "must begin with 'acme:'" in refusal.message
    await h.submit(request("acme:42", "acme", reply_to="llmq.replies.ingest-a"))
    assert h.sent[-1][0] == "llmq.requests.normal.short"  # its own id: admitted


async def test_an_id_scoped_to_another_tenant_is_refused_wherever_it_asks_for_replies(
) -> None:
    # Sent to acme's own topic, "victim:42" was admitted: victim's HTTP call using
    # x-request-id 42 (scoped "victim:42") was then refused as a reused id, for as long
    # as acme's request and the scheduler's memory of it lasted (a squat).
    h = Harness(load_tenancy(None))
    await h.submit(request("victim:42", "acme"))
    [refusal] = h.replies()
    assert (refusal.request_id, refusal.code) == ("victim:42", "invalid")
    assert "scoped to another tenant" in refusal.message
    assert h.sent[0][0] == "llmq.replies.acme" and h.reservations == {}
    await h.submit(request("victim:42", "victim", reply_to="llmq.replies.victim"))
    assert h.sent[-1][0] == "llmq.requests.normal.short"  # the id is victim's to use
    # And no probe: with victim:42 in flight, acme gets the same answer as for any other
    # victim id (the in-flight check used to answer first, and differently).
    await h.submit(request("victim:42", "acme"))
    await h.submit(request("victim:43", "acme"))
    assert [r.message for r in h.replies()[1:]] == [
        refusal.message, refusal.message.replace("victim:42", "victim:43")]
    for plain in ("job-7", "acme:job-8"):  # unscoped, or acme's own scope: admitted
        await h.submit(request(plain, "acme"))
        assert h.sent[-1][0] == "llmq.requests.normal.short"


async def test_a_settle_record_of_another_tenant_settles_nothing() -> None:
    h = Harness(load_tenancy(None))
    await h.submit(request("job-1", "team-a"))
    before = dict(h.buckets["team-a"])
    other = SettleRecord(tenant="team-b", request_id="job-1", used_tokens=1, reason="done",
                         ts=NOW)
    await h.handler.on_settle(Record(encode(other), b"team-b", TOPICS.settle))
    assert "job-1" in h.reservations and h.buckets["team-a"] == before


async def test_open_mode_refuses_the_reserved_tenant_names() -> None:
    # A tenant "ingest-a" would have the ingest instance's topic as its own reply topic:
    # its refusals would end HTTP calls waiting there.
    h = Harness(load_tenancy(None))
    with pytest.raises(SchemaError, match="unknown tenant"):
        await h.submit(request("cmpl-victim", "ingest-a"))
    bad = encode(request("cmpl-victim", "ingest-a")).replace(b'"max_tokens":10',
                                                            b'"max_tokens":0')
    with pytest.raises(SchemaError):
        await h.handler.on_request(Record(bad, b"ingest-a"))
    assert h.sent == [] and h.ensured == []


async def test_unauthorized_reply_to_is_invalid_on_the_tenants_own_topic() -> None:
    h = Harness(parse_tenants(Path("t.toml"), KEYED))
    await h.submit(request("r1", "acme", reply_to="llmq.replies.other"))
    codes = [(e.request_id, e.code) for e in h.replies()]
    assert codes == [("r1", "invalid")]
    assert [t for t, _, _ in h.sent] == ["llmq.replies.acme"]


@pytest.mark.parametrize("reply_to", [None, "llmq.replies.other", "llmq.replies.ingest-a"])
async def test_a_tenant_with_no_policy_is_dead_lettered_and_no_topic_is_made(
    reply_to: str | None,
) -> None:
    # The tenant name is the sender's choice: a reply topic per name would let any Kafka
    # client make ingest create topics without bound.
    h = Harness(parse_tenants(Path("t.toml"), KEYED))
    for i in range(3):
        with pytest.raises(SchemaError, match="unknown tenant") as raised:
            await h.submit(request(f"r{i}", f"stranger{i}", reply_to=reply_to))
        assert raised.value.field == "tenant"
    assert h.sent == [] and h.ensured == []
    assert h.buckets == {} and h.reservations == {}


async def test_an_undecodable_request_of_a_tenant_with_no_policy_gets_no_topic() -> None:
    h = Harness(parse_tenants(Path("t.toml"), KEYED))
    bad = encode(request(tenant="stranger")).replace(b'"max_tokens":10', b'"max_tokens":0')
    with pytest.raises(SchemaError):
        await h.handler.on_request(Record(bad, b"stranger"))
    assert h.sent == [] and h.ensured == []


@pytest.mark.parametrize("reply_to", [
    "llmq.replies.ingest-a.b",  # a dot: not a name the topic catalog takes
    "llmq.replies.ingest-" + "x" * 80,  # longer than the catalog allows
])
async def test_an_instance_reply_topic_no_service_could_create_is_invalid(
    reply_to: str,
) -> None:
    # Scheduler and workers could never send to it (their sends would stall the
    # partition): refused at the door, the answer on the tenant's own topic.
    h = Harness(load_tenancy(None))
    await h.submit(request("r1", "acme", reply_to=reply_to))
    [refusal] = h.replies()
    assert refusal.code == "invalid" and "not authorized" in refusal.message
    assert [t for t, _, _ in h.sent] == ["llmq.replies.acme"]


class BrokenTracker(ClusterTracker):
    def view(self, now: float) -> ClusterView:
        raise RuntimeError("view broke")


async def test_a_failed_decision_still_answers_then_raises() -> None:
    tenancy = load_tenancy(None)
    h = Harness(tenancy, BrokenTracker(tenancy.config.admission.registry))
    with pytest.raises(RuntimeError, match="view broke"):
        await h.submit(request())
    [refusal] = h.replies()
    assert refusal.code == "overloaded" and refusal.retry_after_s == 1.0


class RefusingTable(dict[str, Any]):
    """A table whose writes fail, as Faust's do (PartitionsMismatch) while its consumer
    sees a changelog topic without partitions."""

    def __setitem__(self, key: str, value: Any) -> None:
        raise RuntimeError("PartitionsMismatch: the changelog topic has 0 partitions")


async def test_a_failed_table_write_answers_once_publishes_nothing_then_raises() -> None:
    h = Harness(load_tenancy(None))
    h.handler._reservations = RefusingTable()
    with pytest.raises(RuntimeError, match="PartitionsMismatch"):
        await h.submit(request("cmpl-r1", reply_to="llmq.replies.ingest-a"))
    [(topic, _, _)] = h.sent  # no admitted request went to a request topic
    assert topic == "llmq.replies.ingest-a"
    [refusal] = h.replies()
    assert refusal.code == "overloaded" and "retry" in refusal.message


async def test_terminal_events_become_settle_records_keyed_by_tenant() -> None:
    h = Harness(load_tenancy(None))
    usage = Usage(prompt_tokens=10, completion_tokens=3)
    done = EventDone(request_id="r1", tenant="team-a", attempt=1, worker_id="w", ts=NOW,
                     finish_reason="stop", usage=usage)
    started = EventStarted(request_id="r1", tenant="team-a", attempt=1, worker_id="w", ts=NOW)
    await h.handler.on_event(Record(encode(started), b"r1", TOPICS.events))
    await h.handler.on_event(Record(encode(done), b"r1", TOPICS.events))
    [(topic, key, value)] = h.sent
    assert (topic, key) == (TOPICS.settle, b"team-a")
    record = decode(value, SettleRecord)
    assert (record.request_id, record.used_tokens, record.reason) == ("r1", 13, "done")


async def test_settle_refunds_releases_and_is_idempotent() -> None:
    h = Harness(load_tenancy(None))
    await h.submit(request())
    after_admit = TenantState.from_dict(h.buckets["default"])
    settle = SettleRecord(tenant="default", request_id="r1", used_tokens=12, reason="done",
                          ts=NOW)
    await h.handler.on_settle(Record(encode(settle), b"default", TOPICS.settle))
    settled = TenantState.from_dict(h.buckets["default"])
    assert settled.in_flight == 0 and "r1" not in h.reservations
    assert settled.tokens == pytest.approx(after_admit.tokens + 20 - 12)
    await h.handler.on_settle(Record(encode(settle), b"default", TOPICS.settle))
    assert h.buckets["default"] == settled.to_dict()


class BucketsFailOnce(dict[str, Any]):
    """A buckets table whose next write fails once."""

    fail = False

    def __setitem__(self, key: str, value: Any) -> None:
        if self.fail:
            self.fail = False
            raise RuntimeError("changelog write failed")
        super().__setitem__(key, value)


async def test_a_failed_table_write_leaves_the_tenant_nothing_held() -> None:
    """Found by an audit: the bucket (in_flight + 1) was written before the reservation;
    the reservation's write failing left a charge nothing would ever settle, and four such
    failures locked a tenant of max_concurrency 4 out for good."""
    h = Harness(load_tenancy(None))
    h.handler._reservations = RefusingTable()
    with pytest.raises(RuntimeError):
        await h.submit(request("r1"))
    assert "default" not in h.buckets  # nothing charged
    h = Harness(load_tenancy(None))
    buckets = h.handler._buckets = BucketsFailOnce()
    buckets.fail = True
    with pytest.raises(RuntimeError):
        await h.submit(request("r1"))
    assert "r1" not in h.reservations and "default" not in buckets  # nor reserved


class ReservationsFailOnce(dict[str, Any]):
    """A reservations table whose next delete fails once."""

    fail = False

    def __delitem__(self, key: str) -> None:
        if self.fail:
            self.fail = False
            raise RuntimeError("changelog write failed")
        super().__delitem__(key)


@pytest.mark.parametrize("failing", ["the bucket's write", "the reservation's delete"])
async def test_a_settle_whose_table_write_fails_is_settled_once_at_expiry(failing: str) -> None:
    """Found by audits. The reservation popped before the bucket was credited: a failure
    between left in_flight charged for good. Then the bucket credited first: a failure
    between left the reservation, and its expiry (the failed settle record is dead-lettered,
    never redelivered) credited the bucket a second time, one slot more than the tenant's
    concurrency for good."""
    h = Harness(load_tenancy(None))
    buckets = h.handler._buckets = BucketsFailOnce()
    reservations = h.handler._reservations = h.reservations = ReservationsFailOnce()
    await h.submit(request("r1", timeout_s=10.0))
    await h.submit(request("r2", timeout_s=600.0))
    assert TenantState.from_dict(buckets["default"]).in_flight == 2
    settle = SettleRecord(tenant="default", request_id="r1", used_tokens=12, reason="done",
                          ts=NOW)
    if failing == "the bucket's write":
        buckets.fail = True
    else:
        reservations.fail = True
    with pytest.raises(RuntimeError):
        await h.handler.on_settle(Record(encode(settle), b"default", TOPICS.settle))
    assert "r1" in reservations
    assert TenantState.from_dict(buckets["default"]).in_flight == 2  # as before
    (expired,) = h.handler.expired(NOW + 41)
    await h.handler.on_settle(Record(encode(expired), b"default", TOPICS.settle))
    assert sorted(reservations) == ["r2"]
    assert TenantState.from_dict(buckets["default"]).in_flight == 1  # r2's


async def test_expired_reservations_are_found() -> None:
    h = Harness(load_tenancy(None))
    await h.submit(request("r1", timeout_s=10.0))
    await h.submit(request("r2", timeout_s=600.0))
    assert list(h.handler.expired(NOW + 39)) == []
    [expired] = list(h.handler.expired(NOW + 41))
    assert (expired.request_id, expired.reason, expired.used_tokens) == ("r1", "expired", None)


async def test_only_the_partitions_held_now_are_expired_here() -> None:
    """Found by an audit: rows of a partition a rebalance took away stay in Faust's memory
    table, and this instance sent their settle records again at every scan, for good."""
    h = Harness(load_tenancy(None), owner_partition=lambda key: 0)
    await h.submit(request("r1", timeout_s=10.0))
    late = NOW + 41
    assert list(h.handler.expired(late, owned={1, 2})) == []  # partition 0 went elsewhere
    assert [r.request_id for r in h.handler.expired(late, owned={0})] == ["r1"]
    assert [r.request_id for r in h.handler.expired(late)] == ["r1"]  # not told: all


def test_ingest_creates_its_table_changelogs_before_faust_does() -> None:
    wanted = {t.name: t for t in TOPICS.to_create()}
    for table in ("buckets", "reservations"):
        changelog = wanted[f"llmq-ingest-{table}-changelog"]  # Faust's name for it
        assert changelog.partitions == TOPICS.partitions
        assert changelog.config == {"cleanup.policy": "compact"}
    assert wanted["llmq-ingest-__assignor-__leader"].partitions == 1



async def test_a_reply_topic_that_fails_to_be_made_is_tried_again_not_dead_lettered() -> None:
    # The refusal is decided; a broker blip while making the tenant's reply topic sure
    # raised to the guard, which dead-lettered the valid request: no answer for its client.
    h = Harness(parse_tenants(Path("t.toml"), KEYED))
    await h.submit(request("r1", "acme"))
    failures: list[Exception] = [KafkaTimeoutError(), TimeoutError()]
    ensure = h.handler._ensure_topic

    async def flaky(topic: str) -> None:
        if failures:
            h.ensured.append(f"failed: {topic}")
            raise failures.pop(0)
        await ensure(topic)

    h.handler._ensure_topic = flaky
    await h.submit(request("r2", "acme"))  # request_burst 1: refused
    assert [r.request_id for r in h.replies()] == ["r2"]
    assert h.ensured == ["failed: llmq.replies.acme"] * 2 + ["llmq.replies.acme"]
    # What no retry can mend still goes to the guard.
    h.handler._known_topics.discard("llmq.replies.acme")
    failures.append(TopicAuthorizationFailedError())
    with pytest.raises(TopicAuthorizationFailedError):
        await h.submit(request("r3", "acme"))


async def test_a_reply_topic_failing_for_a_minute_is_given_up_to_the_guard() -> None:
    # Not a blip: the record goes to the guard (dead letter) and admission goes on for
    # every other tenant, instead of this agent waiting on it for good.
    h = Harness(parse_tenants(Path("t.toml"), KEYED))
    await h.submit(request("r1", "acme"))

    async def down(topic: str) -> None:
        h.now += 25.0  # each try costs the wait for the broker
        raise TimeoutError

    h.handler._ensure_topic = down
    with pytest.raises(TimeoutError):
        await h.submit(request("r2", "acme"))
    assert h.now - NOW == 75.0  # three tries: past the minute on the third


async def test_a_reply_to_naming_no_running_ingest_instance_is_refused_not_created() -> None:
    # Any well-formed `<prefix>.replies.ingest-<id>` was accepted and its topic created
    # (here, by the scheduler and workers downstream): a tenant could make topics at will.
    h = Harness(load_tenancy(None), existing={"llmq.replies.ingest-b"})  # another instance
    await h.submit(request("cmpl-r1", reply_to="llmq.replies.ingest-b"))
    await h.submit(request("cmpl-r2", reply_to="llmq.replies.ingest-forged1"))
    [(_, _, admitted)] = [s for s in h.sent if s[0].startswith("llmq.requests.")]
    assert decode(admitted, REQUEST_ADAPTER).request_id == "cmpl-r1"
    [refusal] = h.replies()
    assert (refusal.request_id, refusal.code) == ("cmpl-r2", "invalid")
    assert "no running ingest instance" in refusal.message
    assert [t for t, _, _ in h.sent if t.endswith("forged1")] == []
    assert h.ensured == ["llmq.replies.default"]  # the tenant's own, for the refusal
    await h.submit(request("cmpl-r3", reply_to="llmq.replies.ingest-b"))
    await h.submit(request("cmpl-r4", reply_to="llmq.replies.ingest-forged1"))
    assert h.checked == ["llmq.replies.ingest-b", "llmq.replies.ingest-forged1"]  # once each
    h.now += 11.0  # a missing one is asked about again after a while (it may have started)
    await h.submit(request("cmpl-r5", reply_to="llmq.replies.ingest-forged1"))
    assert h.checked[-1] == "llmq.replies.ingest-forged1" and len(h.checked) == 3


async def test_an_admission_the_producer_refuses_is_undone_and_answered() -> None:
    """Found by an audit: the send of the admitted request raising (a full buffer in a
    broker stall) dead-lettered the record with its reservation kept: no reply ever, and
    the slot held until expiry. Undone now, and answered overloaded."""
    h = Harness(load_tenancy(None))
    await h.submit(request("r0"))  # another request of the tenant, in flight
    before = dict(h.buckets["default"])
    publish = h.handler._publish

    async def refusing(topic: str, key: bytes, value: bytes, headers: Any = None) -> None:
        if topic.startswith("llmq.requests."):
            raise KafkaTimeoutError()
        await publish(topic, key, value, headers)

    h.handler._publish = refusing
    with pytest.raises(KafkaTimeoutError):
        await h.submit(request("r1"))
    assert "r1" not in h.reservations and h.buckets["default"] == before
    [refusal] = [e for e in h.replies() if e.request_id == "r1"]
    assert refusal.code == "overloaded"


async def test_a_created_at_so_far_behind_that_its_deadline_is_long_past_is_refused() -> None:
    # Five hours behind (a local time sent as UTC): admitted, it reached the scheduler
    # past its deadline by more than the scheduler remembers finished requests, and was
    # acked there with no answer at all (the code before): the client waited for nothing.
    later = NOW + 5 * 3600
    tenancy = load_tenancy(None)
    tracker = ClusterTracker(tenancy.config.admission.registry, Freshness())
    tracker.observe_heartbeat(make_heartbeat(worker_id="w", model=MODEL, ts=later))
    h = Harness(tenancy, tracker)
    h.now = later
    await h.submit(request("r1", created_at=NOW, timeout_s=600.0))
    [refusal] = h.replies()
    assert refusal.code == "invalid" and "check the client's clock" in refusal.message
    assert "18000 s behind" in refusal.message and "r1" not in h.reservations
    # Past its deadline by less: admitted, and the scheduler answers queue_timeout.
    await h.submit(request("r2", created_at=later - 1800, timeout_s=600.0))
    assert "r2" in h.reservations
    # Read late, not sent late (produced in time, ingest down for hours, or a redelivery
    # of one answered before): not the client's clock, not refused here.
    late = encode(request("r3", created_at=NOW, timeout_s=600.0))
    await h.handler.on_request(Record(late, b"default", timestamp=NOW + 1.0))
    assert "r3" in h.reservations


async def test_a_broken_record_off_its_tenants_partition_is_moved_there_not_answered() -> None:
    # On another instance's partition the reservations of its tenant are not at hand, so
    # a broken copy of a request in flight there was answered invalid at attempt 0, a
    # second terminal, which clients took over the real one still to come.
    h = Harness(load_tenancy(None), owner_partition=lambda key: 3)
    bad = encode(request("r1", tenant="acme")).replace(b'"max_tokens":10', b'"max_tokens":0')
    await h.handler.on_request(Record(bad, b"acme", partition=1))  # moved: no raise
    assert h.sent == [(TOPICS.intake, b"acme", bad)] and h.replies() == []
    with pytest.raises(SchemaError):  # on its tenant's partition: answered, dead-lettered
        await h.handler.on_request(Record(bad, b"acme", partition=3))
    [refusal] = h.replies()
    assert (refusal.request_id, refusal.code) == ("r1", "invalid")


def _sample(name: str, **labels: str) -> float:
    from services.common.metrics import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_a_reused_id_for_another_body_is_no_terminal_in_the_counts() -> None:
    """Found by an audit of the metrics: dead-lettered without a reply, it was counted in
    llmq_requests_total{invalid}, and the id's own terminal was counted again later."""
    h = Harness(load_tenancy(None))
    await h.submit(request("r1"))
    terminals = _sample("llmq_requests_total", outcome="invalid")
    refusals = _sample("llmq_rejections_total", code="invalid")
    with pytest.raises(SchemaError):
        await h.submit(request("r1", max_tokens=11))
    assert h.replies() == []
    assert _sample("llmq_requests_total", outcome="invalid") == terminals
    assert _sample("llmq_rejections_total", code="invalid") == refusals + 1


async def test_an_admission_the_producer_refused_is_not_counted_as_admitted_tokens() -> None:
    h = Harness(load_tenancy(None))
    admitted = _sample("llmq_admitted_tokens_total", tenant="default")
    publish = h.handler._publish

    async def refusing(topic: str, *args: Any, **kwargs: Any) -> None:
        if topic.startswith("llmq.requests."):
            raise KafkaTimeoutError()
        await publish(topic, *args, **kwargs)

    h.handler._publish = refusing  # type: ignore[method-assign]
    with pytest.raises(KafkaTimeoutError):
        await h.submit(request("r2"))
    assert [e.code for e in h.replies()] == ["overloaded"]
    assert _sample("llmq_admitted_tokens_total", tenant="default") == admitted
    h.handler._publish = publish  # type: ignore[method-assign]
    await h.submit(request("r3"))
    assert _sample("llmq_admitted_tokens_total", tenant="default") == admitted + 20


@pytest.mark.parametrize("lost", ["reservation", "bucket"])
async def test_a_bucket_and_its_reservations_that_disagree_are_recounted(lost: str) -> None:
    """Found by an audit of the commits: a decision's reservation and bucket are two
    changelog records; a crash between their acknowledgements left one without the other,
    and a bucket whose reservation was lost held that concurrency slot for good."""
    h = Harness(load_tenancy(None), owner_partition=lambda key: 0)
    await h.submit(request("r1"))
    await h.submit(request("r2"))
    assert list(h.handler.miscounted(NOW)) == []
    if lost == "reservation":  # what the tables hold after the restart
        del h.reservations["r1"]
    else:
        h.buckets["default"] = {**h.buckets["default"], "in_flight": 1}
    assert list(h.handler.miscounted(NOW, owned={1})) == []  # not this instance's
    [recount] = h.handler.miscounted(NOW, owned={0})
    assert (recount.tenant, recount.reason) == ("default", "recount")
    await h.handler.on_settle(Record(encode(recount), b"default", TOPICS.settle))
    held = 1 if lost == "reservation" else 2
    assert TenantState.from_dict(h.buckets["default"]).in_flight == held
    assert list(h.handler.miscounted(NOW)) == []
    assert len(h.reservations) == held  # a recount settles no reservation


async def test_a_record_read_again_whose_request_was_refused_before_is_not_decided_again(
) -> None:
    # Refused the first time (its answer is on its reply topic), then read again after a
    # crash: decided again it would now be admitted, after its client was told no.
    h = Harness(load_tenancy(None), answered_before={"r1"})
    await h.submit(request("r1"), offset=3)
    assert h.sent == [] and h.reservations == {} and h.buckets == {}
    assert h.asked_before == [(0, 3, "r1")]
    await h.submit(request("r2"), offset=4)  # not answered before: decided
    assert [topic for topic, _, _ in h.sent] == ["llmq.requests.normal.short"]
    assert list(h.reservations) == ["r2"]


async def test_a_record_read_again_whose_request_holds_a_reservation_is_not_looked_up(
) -> None:
    h = Harness(load_tenancy(None), answered_before={"r1"})
    await h.submit(request("r1"), offset=None)  # no offset (not a Kafka record): no lookup
    assert h.asked_before == [] and list(h.reservations) == ["r1"]
    h.sent.clear()
    await h.submit(request("r1"), offset=5)  # a redelivery of an admission: sent again
    assert h.asked_before == []
    assert [topic for topic, _, _ in h.sent] == ["llmq.requests.normal.short"]


async def test_a_refusal_names_the_intake_record_it_answers_and_an_admission_does_not() -> None:
    h = Harness(load_tenancy(None))
    await h.submit(request("r1", reply_to="llmq.replies.someone-else"), offset=9)
    await h.submit(request("r2"), offset=10)
    [refused, admitted] = h.headers
    assert refused["llmq-intake-record"] == b"0/9"
    assert "llmq-intake-record" not in admitted
