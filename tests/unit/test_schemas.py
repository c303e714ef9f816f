"""Wire models, codec and topic catalog: round trips, frozen samples, bad input, keys."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, TypeAdapter, ValidationError

import schemas
from schemas.base import (
    ID_PATTERN,
    MAX_MESSAGES,
    MAX_PROMPT_CHARS,
    MAX_STOP,
    PREFIX_HASH_PATTERN,
    TENANT_PATTERN,
    FrozenModel,
    WireMessage,
)
from schemas.codec import MAX_RECORD_BYTES, SchemaError, deadletter_headers, decode, encode
from schemas.common import HTTP_STATUS, LANES, PRIORITIES, SCHEMA_VERSION, ErrorCode
from schemas.examples import example_assignment, example_heartbeat, example_request, examples
from schemas.export import json_schema
from schemas.messages import (
    ANY_ADAPTER,
    ASSIGNMENT_ADAPTER,
    CONTROL_ADAPTER,
    EVENT_ADAPTER,
    HEARTBEAT_ADAPTER,
    INTAKE_ADAPTER,
    MESSAGE_MODELS,
    MODEL_BY_KIND,
    REPLY_ADAPTER,
    kind_of,
)
from schemas.replies import Done, Error, Timings, TokenChunk, Usage
from schemas.requests import Assignment, ChatMessage, InferenceRequest, SamplingParams
from schemas.topics import (
    DEADLETTER_FIELD_HEADER,
    DEADLETTER_REASON_HEADER,
    KEY_FIELD,
    catalog,
    find_topic,
    message_key,
    reply_spec,
    reply_topic,
    request_topic,
    request_topics,
)
from schemas.workers import EventFailed, WorkerHeartbeat

SAMPLES = Path(__file__).parents[1] / "data" / "samples"
EXAMPLES = {kind_of(type(m)): m for m in examples()}


def _id(msg: BaseModel) -> str:
    return type(msg).__name__


def _name(model: Any) -> str:
    return str(model.__name__)


def _compact(raw: bytes) -> bytes:
    return json.dumps(json.loads(raw), separators=(",", ":"), ensure_ascii=False).encode()


# --- round trips ----------------------------------------------------------------------------

#: Valid variants beyond the canonical examples: optional fields absent or present.
VARIANTS: list[WireMessage] = [
    example_request().evolve(prompt="Once upon a time", messages=None),
    example_request().evolve(
        messages=[ChatMessage(role="user", content="hi", name="alice")],
        sampling=SamplingParams(),
        lane="long",
        priority="low",
        reply_to="acme.private-replies",
        model_version="rev-3",
        prefix_hash=None,
    ),
    example_request().evolve(prompt="x" * MAX_PROMPT_CHARS, messages=None),
    example_request().evolve(
        messages=[ChatMessage(role="user", content=f"turn {i}") for i in range(MAX_MESSAGES)],
        sampling=SamplingParams(stop=tuple(str(i) for i in range(MAX_STOP)), top_k=40, seed=0),
    ),
    example_heartbeat().evolve(gpu_util=None, model_version=None, draining=True),
    example_assignment().evolve(attempt=3, partition=0),
    EXAMPLES["chunk"].evolve(text="", seq=17),
    EXAMPLES["done"].evolve(
        finish_reason="length",
        timings=Timings(queued_s=0.0, ttft_s=None, e2e_s=0.0),
        usage=Usage(prompt_tokens=0, completion_tokens=0),
    ),
    EXAMPLES["error"].evolve(code="worker_lost", attempt=2, retry_after_s=None),
    EXAMPLES["event.failed"].evolve(usage=None),
    EXAMPLES["event.aborted"].evolve(code="timeout"),
    EXAMPLES["drain"].evolve(reason=""),
    example_request().evolve(prompt='héllo \u2603 \U0001f600 \x00 "quoted"', messages=None),
]


@pytest.mark.parametrize("msg", [*examples(), *VARIANTS], ids=_id)
def test_round_trip_through_bytes(msg: WireMessage) -> None:
    data = encode(msg)
    assert decode(data, type(msg)) == msg
    assert decode(data, ANY_ADAPTER) == msg
    assert encode(decode(data, type(msg))) == data


@pytest.mark.parametrize("msg", examples(), ids=_id)
def test_round_trip_through_topic_spec(msg: WireMessage) -> None:
    specs = [s for s in [*catalog(), reply_spec("llmq", "acme")] if type(msg) in s.models]
    assert len(specs) >= 1
    for spec in specs:
        assert decode(encode(msg), spec) == msg


def test_encode_is_compact_utf8_json_in_field_order() -> None:
    msg = example_request().evolve(prompt="snow \u2603", messages=None)
    data = encode(msg)
    assert b": " not in data and b", " not in data
    assert "\u2603".encode() in data
    assert list(json.loads(data)) == list(type(msg).model_fields)


# --- frozen samples -------------------------------------------------------------------------

SAMPLE_FILES = sorted(SAMPLES.glob("*.json"))


def test_one_sample_per_kind() -> None:
    assert {p.stem for p in SAMPLE_FILES} == set(MODEL_BY_KIND)


@pytest.mark.parametrize("path", SAMPLE_FILES, ids=lambda p: p.stem)
def test_sample_decodes_and_reencodes_identically(path: Path) -> None:
    raw = path.read_bytes()
    msg = decode(raw, ANY_ADAPTER)
    assert msg.kind == path.stem
    assert encode(msg) == _compact(raw)


@pytest.mark.parametrize(("version", "added"), [
    (1, ("engine_priority", "worker_started_at")),
    (2, ("worker_started_at",)),
])
def test_an_older_assignment_still_decodes(version: int, added: tuple[str, ...]) -> None:
    """Schema 2 added ``engine_priority`` (None: the worker gives its engine the admitted
    class), schema 3 ``worker_started_at`` (None: whichever process holds the slot runs
    it); an assignment of an older version, without them, still reads."""
    raw = json.loads((SAMPLES / "assignment.json").read_bytes())
    for name in added:
        del raw[name]
    raw["schema_version"] = version
    msg = decode(json.dumps(raw).encode(), ANY_ADAPTER)
    assert isinstance(msg, Assignment) and msg.schema_version == version
    assert all(getattr(msg, name) is None for name in added)


@pytest.mark.parametrize("version", [1, 2, 3])
def test_an_older_heartbeat_still_decodes(version: int) -> None:
    """Schema 4 added ``renew`` (False: a heartbeat of an older worker never asks)."""
    raw = json.loads((SAMPLES / "heartbeat.json").read_bytes())
    del raw["renew"]
    raw["schema_version"] = version
    msg = decode(json.dumps(raw).encode(), ANY_ADAPTER)
    assert isinstance(msg, WorkerHeartbeat) and msg.schema_version == version
    assert msg.renew is False


def test_worker_started_at_round_trips_exactly() -> None:
    """The worker compares the stamp with its own start time for equality, so the float
    must survive encode/decode bit for bit."""
    for started in (1764412345.123456, 1764412345.1234567, 0.1 + 0.2, 1e9 / 3):
        a = example_assignment().evolve(worker_started_at=started)
        back = decode(encode(a), ANY_ADAPTER)
        assert isinstance(back, Assignment) and back.worker_started_at == started


# --- model rules (STYLE.md §7) --------------------------------------------------------------


def _all_models() -> set[type[BaseModel]]:
    seen: set[type[BaseModel]] = set()
    todo: list[type[BaseModel]] = list(MESSAGE_MODELS)
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for field in model.model_fields.values():
            todo.extend(_models_in(field.annotation))
    return seen


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


@pytest.mark.parametrize("model", sorted(_all_models(), key=str), ids=_name)
def test_model_is_frozen_closed_finite_and_documented(model: type[BaseModel]) -> None:
    assert issubclass(model, FrozenModel)
    assert model.model_config.get("frozen") is True
    assert model.model_config.get("extra") == "forbid"
    assert model.model_config.get("allow_inf_nan") is False
    assert model.__doc__
    undocumented = [n for n, f in model.model_fields.items() if not f.description]
    assert undocumented == []


@pytest.mark.parametrize("model", MESSAGE_MODELS, ids=_name)
def test_message_has_literal_kind_and_schema_version(model: type[WireMessage]) -> None:
    assert list(model.model_fields)[:2] == ["kind", "schema_version"]
    assert get_args(model.model_fields["kind"].annotation) == (kind_of(model),)
    assert model.model_fields["schema_version"].default == SCHEMA_VERSION


def test_kinds_are_unique() -> None:
    assert len(MODEL_BY_KIND) == len(MESSAGE_MODELS)


def test_messages_are_immutable() -> None:
    msg = example_request()
    with pytest.raises(ValidationError):
        msg.max_tokens = 5  # type: ignore[misc]  # the point: frozen models refuse it


def test_evolve_validates() -> None:
    assert example_request().evolve(max_tokens=5).max_tokens == 5
    with pytest.raises(ValidationError):
        example_request().evolve(max_tokens=0)


def test_python_construction_is_strict_but_takes_lists() -> None:
    # Typed callers pass tuples; a list (from untyped code, or via evolve) is accepted too.
    req = example_request().evolve(messages=[ChatMessage(role="user", content="a")])
    assert req.messages == (ChatMessage(role="user", content="a"),)
    with pytest.raises(ValidationError):
        example_request().evolve(max_tokens="12")


def test_error_http_status_follows_code() -> None:
    for code in get_args(ErrorCode):
        err = Error(request_id="r", attempt=0, code=code, message="m", ts=0.0)
        assert err.http_status == HTTP_STATUS[code]
    assert set(HTTP_STATUS) == set(get_args(ErrorCode))


def test_derived_properties() -> None:
    admitted = EXAMPLES["admitted"]
    assert isinstance(admitted, schemas.AdmittedRequest)
    assert admitted.total_tokens == admitted.prompt_tokens + admitted.request.max_tokens
    assert example_assignment().request_id == example_request().request_id
    assert example_request().prompt_chars == sum(
        len(m.content) for m in example_request().messages or ()
    )
    assert example_heartbeat().kv_bytes_per_token == 131_072
    assert Usage(prompt_tokens=2, completion_tokens=3).total_tokens == 5


# --- bad input ------------------------------------------------------------------------------

_DROP = object()


def _mutated(kind: str, changes: dict[str, Any]) -> bytes:
    """The sample of ``kind`` with dotted-path fields replaced (or dropped with ``_DROP``)."""
    obj = json.loads(encode(EXAMPLES[kind]))
    for path, value in changes.items():
        *parents, last = path.split(".")
        node = obj
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if value is _DROP:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    # allow_nan: NaN and Infinity literals are what a careless producer would send.
    return json.dumps(obj, allow_nan=True).encode()


def _raw_replace(kind: str, old: str, new: str) -> bytes:
    data = encode(EXAMPLES[kind]).decode()
    assert old in data
    return data.replace(old, new, 1).encode()


_REQ = "request"
_BIG = "x" * (MAX_PROMPT_CHARS + 1)

# (id, data, target, expected field, expected error type or None)
BAD_INPUT: list[tuple[str, bytes | None, Any, str, str | None]] = [
    ("malformed-json", b'{"kind": "request",', InferenceRequest, "", "json_invalid"),
    ("not-utf8", b"\xff\xfe\xfd", ANY_ADAPTER, "", "json_invalid"),
    ("not-an-object", b"[1, 2]", ANY_ADAPTER, "", None),
    ("scalar", b"42", InferenceRequest, "", None),
    ("empty", b"", REPLY_ADAPTER, "", "record_empty"),
    ("tombstone", None, HEARTBEAT_ADAPTER, "", "record_empty"),
    ("too-large", b" " * (MAX_RECORD_BYTES + 1), ANY_ADAPTER, "", "record_too_large"),
    ("unknown-kind", b'{"kind": "bogus"}', ANY_ADAPTER, "kind", "union_tag_invalid"),
    ("missing-kind", b'{"request_id": "r"}', REPLY_ADAPTER, "kind", "union_tag_not_found"),
    ("kind-of-other-topic", encode(example_request()), REPLY_ADAPTER, "kind", None),
    ("wrong-kind-single", _mutated(_REQ, {"kind": "done"}), InferenceRequest, "kind", None),
    ("max-tokens-string", _mutated(_REQ, {"max_tokens": "12"}), INTAKE_ADAPTER, "max_tokens",
     "int_type"),
    ("max-tokens-float", _mutated(_REQ, {"max_tokens": 12.5}), InferenceRequest, "max_tokens",
     None),
    ("max-tokens-negative", _mutated(_REQ, {"max_tokens": -1}), InferenceRequest, "max_tokens",
     "greater_than_equal"),
    ("max-tokens-zero", _mutated(_REQ, {"max_tokens": 0}), InferenceRequest, "max_tokens",
     "greater_than_equal"),
    ("max-tokens-missing", _mutated(_REQ, {"max_tokens": _DROP}), InferenceRequest,
     "max_tokens", "missing"),
    ("bool-as-int", _mutated("heartbeat", {"draining": 1}), HEARTBEAT_ADAPTER, "draining",
     "bool_type"),
    ("timestamp-string", _mutated(_REQ, {"created_at": "2024-01-01"}), InferenceRequest,
     "created_at", None),
    ("nan-literal", _mutated(_REQ, {"sampling.temperature": float("nan")}), INTAKE_ADAPTER,
     "sampling.temperature", "finite_number"),
    ("infinity-literal", _mutated("heartbeat", {"tokens_per_s": float("inf")}),
     HEARTBEAT_ADAPTER, "tokens_per_s", "finite_number"),
    ("overflow-1e999", _raw_replace(_REQ, '"created_at":1700000000.0', '"created_at":1e999'),
     InferenceRequest, "created_at", "finite_number"),
    ("negative-overflow", _raw_replace("chunk", '"ts":1700000000.061', '"ts":-1e999'),
     REPLY_ADAPTER, "ts", "finite_number"),
    ("oversized-prompt", _mutated(_REQ, {"prompt": _BIG, "messages": None}), InferenceRequest,
     "prompt", "string_too_long"),
    ("oversized-chat", _mutated(_REQ, {"messages.1.content": _BIG}), InferenceRequest,
     "messages.1.content", "string_too_long"),
    ("chat-total-too-long",
     _mutated(_REQ, {"messages.0.content": "x" * MAX_PROMPT_CHARS, "messages.1.content": "y"}),
     InferenceRequest, "messages", "too_long"),
    ("too-many-messages",
     _mutated(_REQ, {"messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)}),
     InferenceRequest, "messages", "too_long"),
    ("no-messages", _mutated(_REQ, {"messages": []}), InferenceRequest, "messages", "too_short"),
    ("bad-role", _mutated(_REQ, {"messages.0.role": "robot"}), InferenceRequest,
     "messages.0.role", "literal_error"),
    ("prompt-and-messages", _mutated(_REQ, {"prompt": "hi"}), InferenceRequest, "messages",
     "value_error"),
    ("neither-prompt-nor-messages", _mutated(_REQ, {"messages": _DROP}), InferenceRequest,
     "messages", "value_error"),
    ("too-many-stops", _mutated(_REQ, {"sampling.stop": ["s"] * (MAX_STOP + 1)}),
     InferenceRequest, "sampling.stop", "too_long"),
    ("stop-not-string", _mutated(_REQ, {"sampling.stop": [1]}), InferenceRequest,
     "sampling.stop.0", "string_type"),
    ("top-p-zero", _mutated(_REQ, {"sampling.top_p": 0}), InferenceRequest, "sampling.top_p",
     "greater_than"),
    ("timeout-zero", _mutated(_REQ, {"timeout_s": 0}), InferenceRequest, "timeout_s",
     "greater_than"),
    ("extra-field", _mutated(_REQ, {"surprise": 1}), InferenceRequest, "surprise",
     "extra_forbidden"),
    ("extra-nested-field", _mutated(_REQ, {"sampling.best_of": 2}), InferenceRequest,
     "sampling.best_of", "extra_forbidden"),
    ("id-with-space", _mutated(_REQ, {"request_id": "has space"}), InferenceRequest,
     "request_id", "string_pattern_mismatch"),
    ("id-too-long", _mutated(_REQ, {"request_id": "r" * 129}), InferenceRequest, "request_id",
     None),
    ("tenant-with-dot", _mutated(_REQ, {"tenant": "a.b"}), InferenceRequest, "tenant",
     "string_pattern_mismatch"),
    ("reply-to-not-a-topic", _mutated(_REQ, {"reply_to": "a/b"}), InferenceRequest, "reply_to",
     "string_pattern_mismatch"),
    ("newer-schema-version", _mutated(_REQ, {"schema_version": SCHEMA_VERSION + 1}),
     InferenceRequest, "schema_version", "less_than_equal"),
    ("kv-free-above-total", _mutated("heartbeat", {"kv_free_tokens": 200_001}),
     HEARTBEAT_ADAPTER, "kv_free_tokens", "value_error"),
    ("gpu-util-above-one", _mutated("heartbeat", {"gpu_util": 1.5}), HEARTBEAT_ADAPTER,
     "gpu_util", "less_than_equal"),
    ("chunk-negative-seq", _mutated("chunk", {"seq": -1}), REPLY_ADAPTER, "seq",
     "greater_than_equal"),
    ("attempt-zero", _mutated("event.started", {"attempt": 0}), EVENT_ADAPTER, "attempt",
     "greater_than_equal"),
    ("unknown-error-code", _mutated("error", {"code": "oops"}), REPLY_ADAPTER, "code",
     "literal_error"),
    ("cancel-missing-tenant", _mutated("cancel", {"tenant": _DROP}), CONTROL_ADAPTER, "tenant",
     "missing"),
    # "admitted" is both a kind and a field of Assignment: the path must keep it.
    ("nested-field-single", _mutated("assignment", {"admitted.request.max_tokens": 0}),
     ASSIGNMENT_ADAPTER, "admitted.request.max_tokens", "greater_than_equal"),
    ("nested-field-union", _mutated("assignment", {"admitted.request.max_tokens": 0}),
     ANY_ADAPTER, "admitted.request.max_tokens", "greater_than_equal"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("data", "target", "field", "error_type"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD_INPUT],
)
def test_bad_input_raises_schema_error_naming_the_field(
    data: bytes | None, target: Any, field: str, error_type: str | None
) -> None:
    with pytest.raises(SchemaError) as caught:
        decode(data, target)
    err = caught.value
    assert err.field == field
    if error_type is not None:
        assert err.type == error_type
    assert str(err).startswith(f"{field or '<record>'}: ")
    assert err.errors[0].field == field


def test_schema_error_is_a_value_error_with_an_error_code() -> None:
    with pytest.raises(ValueError, match="prompt"):
        decode(_mutated(_REQ, {"prompt": _BIG, "messages": None}), InferenceRequest)
    with pytest.raises(SchemaError) as caught:
        decode(_mutated(_REQ, {"prompt": _BIG, "messages": None}), InferenceRequest)
    assert caught.value.error_code == "too_large"
    with pytest.raises(SchemaError) as caught:
        decode(_mutated(_REQ, {"max_tokens": -1}), InferenceRequest)
    assert caught.value.error_code == "invalid"


@pytest.mark.parametrize("changes", [
    {"model": "m" * 300},
    {"request_id": "r" * 200},
    {"model_version": "v" * 5000},
    {"sampling": {"stop": ["s"] * 9}},
    {"sampling": {"stop": ["s" * 300]}},
], ids=["model", "request_id", "model_version", "nine stops", "long stop"])
def test_an_over_long_short_field_is_invalid_not_too_large(changes: dict[str, Any]) -> None:
    """Found by an audit: over Kafka these were refused too_large (413); the HTTP API, and
    this, call a malformed request invalid. Only the input (prompt, messages) is too large."""
    with pytest.raises(SchemaError) as caught:
        decode(_mutated(_REQ, changes), InferenceRequest)
    assert caught.value.error_code == "invalid"


def test_a_discriminator_that_forges_a_log_line_is_printed_escaped() -> None:
    """Found by an audit: pydantic quotes the sender's ``kind`` in its message, which went
    raw into the dead letter's reason and the log line (a newline forged one)."""
    with pytest.raises(SchemaError) as caught:
        decode(b'{"kind": "x\\nFAKE LOG LINE level=ERROR"}', REPLY_ADAPTER)
    assert str(caught.value).isprintable() and "\\n" in str(caught.value)
    headers = dict(deadletter_headers(caught.value, "t", 0, 1))
    assert b"\n" not in headers["llmq-dlq-reason"]


def test_schema_error_lists_every_failure_without_echoing_input() -> None:
    secret = "top secret prompt text"
    data = _mutated(_REQ, {"max_tokens": -1, "priority": secret, "messages": None})
    with pytest.raises(SchemaError) as caught:
        decode(data, InferenceRequest)
    fields = [e.field for e in caught.value.errors]
    # In field order, and the first is the one .field names.
    assert fields == ["messages", "max_tokens", "priority"]
    assert caught.value.field == "messages"
    assert "(and" in str(caught.value)
    assert secret not in repr(caught.value.errors)


def test_schema_error_message_is_bounded() -> None:
    with pytest.raises(SchemaError) as caught:
        decode(json.dumps({"kind": "k" * 10_000}).encode(), ANY_ADAPTER)
    assert len(str(caught.value)) < 400


def test_decode_accepts_bytearray_and_memoryview() -> None:
    data = encode(example_request())
    assert decode(bytearray(data), InferenceRequest) == example_request()
    assert decode(memoryview(data), InferenceRequest) == example_request()


def test_deadletter_topic_has_no_decoder() -> None:
    with pytest.raises(TypeError):
        decode(b"{}", find_topic("llmq.deadletter"))


def test_deadletter_headers() -> None:
    with pytest.raises(SchemaError) as caught:
        decode(_mutated(_REQ, {"max_tokens": -1}), InferenceRequest)
    headers = dict(deadletter_headers(caught.value, "llmq.intake", 2, 41))
    assert headers[DEADLETTER_FIELD_HEADER] == b"max_tokens"
    assert headers[DEADLETTER_REASON_HEADER].startswith(b"max_tokens: ")
    assert b"llmq.intake/2/41" in headers.values()
    assert dict(deadletter_headers("poison", "t", 0, 0))[DEADLETTER_FIELD_HEADER] == b""


@pytest.mark.parametrize(("key", "field"), [
    ("x" * 5_000_000, "x" * 64 + "..."),  # the sender's key: a short field, a small letter
    ("a\nERROR forged line", "a\\nERROR forged line"),  # no forged log lines
])
def test_an_unknown_key_is_named_short_and_printable(key: str, field: str) -> None:
    with pytest.raises(SchemaError) as caught:
        decode(_mutated(_REQ, {key: 1}), InferenceRequest)
    assert caught.value.field == field
    headers = deadletter_headers(caught.value, "llmq.intake", 0, 1)
    assert sum(len(v) for _, v in headers) < 1_000


# --- properties -----------------------------------------------------------------------------

_text = st.text(st.characters(codec="utf-8"), max_size=200)
_chat = st.builds(
    ChatMessage,
    role=st.sampled_from(["system", "user", "assistant", "tool"]),
    content=_text,
    name=st.none() | st.from_regex(r"\A[a-z][a-z0-9_-]{0,15}\Z"),
)
_sampling = st.builds(
    SamplingParams,
    temperature=st.floats(0.0, 2.0),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    top_k=st.none() | st.integers(1, 100_000),
    presence_penalty=st.floats(-2.0, 2.0),
    frequency_penalty=st.floats(-2.0, 2.0),
    stop=st.lists(st.text(min_size=1, max_size=20), max_size=MAX_STOP),
    seed=st.none() | st.integers(0, (1 << 63) - 1),
)
_prompt_or_messages = st.one_of(
    st.tuples(st.text(min_size=1, max_size=500), st.none()),
    st.tuples(st.none(), st.lists(_chat, min_size=1, max_size=8)),
)


@st.composite
def requests(draw: st.DrawFn) -> InferenceRequest:
    prompt, messages = draw(_prompt_or_messages)
    return InferenceRequest(
        request_id=draw(st.from_regex(ID_PATTERN.replace("^", r"\A").replace("$", r"\Z"))),
        tenant=draw(st.from_regex(TENANT_PATTERN.replace("^", r"\A").replace("$", r"\Z"))),
        model=draw(st.sampled_from(["m", "meta-llama/Llama-3.1-8B-Instruct", "qwen:7b"])),
        prompt=prompt,
        messages=None if messages is None else tuple(messages),
        max_tokens=draw(st.integers(1, 1 << 20)),
        sampling=draw(_sampling),
        priority=draw(st.sampled_from(PRIORITIES)),
        lane=draw(st.none() | st.sampled_from(LANES)),
        timeout_s=draw(st.floats(0.0, 86_400.0, exclude_min=True)),
        # "." and ".." match the pattern but are no Kafka topic names (refused: ec98dd8).
        reply_to=draw(st.none() | st.from_regex(r"\A[a-z0-9._-]{1,40}\Z").filter(
            lambda name: name not in (".", ".."))),
        created_at=draw(st.floats(0.0, 4e9)),
        prefix_hash=draw(
            st.none() | st.from_regex(PREFIX_HASH_PATTERN.replace("^", r"\A").replace("$", r"\Z"))
        ),
    )


_REQUEST_JSON_SCHEMA = jsonschema.Draft202012Validator(json_schema(InferenceRequest))


@given(requests())
def test_any_valid_request_round_trips(req: InferenceRequest) -> None:
    data = encode(req)
    assert decode(data, InferenceRequest) == req
    assert decode(data, INTAKE_ADAPTER) == req
    assert encode(decode(data, ANY_ADAPTER)) == data
    # The exported JSON Schema accepts whatever the models accept.
    _REQUEST_JSON_SCHEMA.validate(json.loads(data))


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)


@settings(max_examples=200)
@given(st.binary(max_size=200) | _json.map(lambda v: json.dumps(v).encode()))
def test_decode_raises_only_schema_error_on_garbage(data: bytes) -> None:
    for target in (ANY_ADAPTER, InferenceRequest, REPLY_ADAPTER):
        with contextlib.suppress(SchemaError):
            decode(data, target)


@settings(max_examples=200)
@given(
    kind=st.sampled_from(sorted(MODEL_BY_KIND)),
    field=st.text(max_size=12),
    value=_json,
)
def test_decode_raises_only_schema_error_on_corrupted_messages(
    kind: str, field: str, value: Any
) -> None:
    obj = json.loads(encode(EXAMPLES[kind]))
    obj[field if field in obj or not obj else sorted(obj)[len(field) % len(obj)]] = value
    try:
        decode(json.dumps(obj).encode(), ANY_ADAPTER)
    except SchemaError as exc:
        assert exc.field == "" or exc.field.split(".")[0] in obj


# --- topic catalog --------------------------------------------------------------------------


def test_catalog_names() -> None:
    names = [s.name for s in catalog()]
    assert names == [
        "llmq.intake",
        "llmq.requests.high.short",
        "llmq.requests.high.long",
        "llmq.requests.normal.short",
        "llmq.requests.normal.long",
        "llmq.requests.low.short",
        "llmq.requests.low.long",
        "llmq.heartbeats",
        "llmq.status",
        "llmq.assignments",
        "llmq.events",
        "llmq.control",
        "llmq.deadletter",
    ]
    assert request_topics() == names[1:7]


def test_catalog_prefix_partitions_and_tenants() -> None:
    specs = {s.name: s for s in catalog("t-1a2b.llmq", assignment_partitions=4, tenants=["x"])}
    assert specs["t-1a2b.llmq.assignments"].partitions == 4
    assert "t-1a2b.llmq.replies.x" in specs
    assert all(name.startswith("t-1a2b.llmq.") for name in specs)


def test_catalog_policies_and_keys() -> None:
    specs = {s.name.removeprefix("llmq."): s for s in catalog()}
    assert specs["heartbeats"].cleanup_policy == "compact"
    assert specs["heartbeats"].config["cleanup.policy"] == "compact"
    assert specs["status"].cleanup_policy == "compact"
    compacted = ("heartbeats", "status")
    assert [s.cleanup_policy for k, s in specs.items() if k not in compacted] == ["delete"] * 11
    assert specs["status"].key == "model"
    assert specs["intake"].key == "tenant"
    assert specs["heartbeats"].key == "worker_id"
    assert specs["deadletter"].key is None
    for name in ("assignments", "events", *(t.removeprefix("llmq.") for t in request_topics())):
        assert specs[name].key == "request_id"
    assert int(specs["intake"].config["max.message.bytes"]) >= MAX_RECORD_BYTES


def test_every_message_has_a_topic() -> None:
    carried = {m for s in [*catalog(), reply_spec("llmq", "a")] for m in s.models}
    assert carried == set(MESSAGE_MODELS)


@pytest.mark.parametrize("msg", examples(), ids=_id)
def test_message_key(msg: WireMessage) -> None:
    assert message_key(msg) == str(getattr(msg, KEY_FIELD[type(msg)])).encode()


def test_message_key_rules() -> None:
    assert message_key(example_request()) == b"acme"
    assert message_key(example_heartbeat()) == message_key(EXAMPLES["drain"]) == b"worker-a100-0"
    assert message_key(example_assignment()) == message_key(EXAMPLES["cancel"])


def test_topic_helpers() -> None:
    assert request_topic("llmq", "high", "long") == "llmq.requests.high.long"
    assert reply_topic("p", "acme") == "p.replies.acme"
    assert find_topic("llmq.replies.acme").models == (TokenChunk, Done, Error)
    assert find_topic("llmq.events").adapter is EVENT_ADAPTER
    for bad in (
        lambda: reply_topic("llmq", "a.b"),
        lambda: reply_topic("bad prefix", "a"),
        lambda: request_topic("llmq", "urgent", "short"),  # type: ignore[arg-type]
        lambda: find_topic("other.intake"),
        lambda: catalog(assignment_partitions=0),
    ):
        with pytest.raises(ValueError):
            bad()


# --- package surface ------------------------------------------------------------------------


def test_package_reexports_resolve() -> None:
    for name in schemas.__all__:
        assert getattr(schemas, name) is not None
    assert schemas.EventFailed is EventFailed
    assert isinstance(schemas.INTAKE_ADAPTER, TypeAdapter)
    with pytest.raises(AttributeError):
        _ = schemas.nope


def test_common_imports_no_pydantic_models() -> None:
    code = "import sys, schemas.common; print('schemas.base' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_builders_cover_every_kind() -> None:
    from tests import builders_schemas as b

    assert [kind_of(type(m)) for m in b.sample_messages()] == list(MODEL_BY_KIND)
    assert b.make_prompt_request("hi").prompt == "hi"
    assert b.make_request(max_tokens=9).max_tokens == 9
    assert b.make_assignment(attempt=2).attempt == 2
    assert b.make_heartbeat(running=0).running == 0
    assert b.make_admitted(lane="long").lane == "long"
    assert b.make_chunk(seq=4).seq == 4
    assert b.make_done(attempt=2).attempt == 2
    assert b.make_error(code="timeout").http_status == 504
    assert b.make_drain(reason="r").reason == "r"
    assert b.make_cancel(reason="r").reason == "r"
    with pytest.raises(ValidationError):
        b.make_chunk(tokens=0)


def test_kv_transfer_refuses_nan_and_infinity_anywhere_inside() -> None:
    """Found by an audit: JSON parsing let 1e999 into kv_transfer (a JsonValue), encoding
    wrote it back as null, and the scheduler rebuilding the decode stage's assignment from
    it failed every cycle; now the record is refused naming the field."""
    ok = example_assignment()
    for bad in (b"1e999", b"-1e999", b"NaN", b"Infinity", b'{"deep": [1, 1e999]}'):
        wire = encode(ok).replace(b'"kv_transfer":null', b'"kv_transfer":{"x":' + bad + b"}")
        if wire == encode(ok):  # the example has parameters: put the bad one first
            wire = encode(ok).replace(b'"kv_transfer":{', b'"kv_transfer":{"x":' + bad + b",")
        with pytest.raises(SchemaError) as err:
            decode(wire, Assignment)
        assert err.value.field.startswith("kv_transfer") and "finite" in str(err.value)
    finite = encode(ok).replace(b'"kv_transfer":null', b'"kv_transfer":{"x":[1.5,{"y":2}]}')
    assert decode(finite, Assignment) == decode(encode(decode(finite, Assignment)), Assignment)


@pytest.mark.parametrize("name", [".", ".."])
def test_a_topic_name_kafka_refuses_is_refused(name: str) -> None:
    with pytest.raises(ValidationError, match="not Kafka topic names"):
        InferenceRequest.model_validate({**example_request().model_dump(), "reply_to": name})


def test_an_unknown_empty_key_is_named_not_read_as_the_whole_record() -> None:
    chunk = TokenChunk(request_id="r1", attempt=1, seq=0, text="a", tokens=1, ts=1.0)
    with pytest.raises(SchemaError) as err:
        decode(encode(chunk)[:-1] + b',"":1}', TokenChunk)
    assert err.value.field == '""' and err.value.error_code == "invalid"
