"""JSON Schema and AsyncAPI export: files written, schemas valid, AsyncAPI 3.0.0 conformant.

The AsyncAPI document is validated against the official 3.0.0 JSON Schema vendored in
tests/data (see its README); a deliberately broken copy must fail, so the check is real.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from schemas.codec import encode
from schemas.examples import examples
from schemas.export import JSON_SCHEMA_DIALECT, asyncapi_document, export, schema_filename
from schemas.messages import MESSAGE_MODELS, MODEL_BY_KIND, kind_of
from schemas.topics import catalog

ASYNCAPI_SCHEMA = Path(__file__).parents[1] / "data" / "asyncapi-3.0.0.json"


@cache
def asyncapi_validator() -> jsonschema.Draft7Validator:
    """Validator for AsyncAPI 3.0.0 documents.

    The official schema is draft-07 and keeps every sub-schema under ``definitions`` with its
    own ``$id`` (``http://asyncapi.com/definitions/3.0.0/...``); crawling the registry makes
    those ids resolvable offline.
    """
    spec = json.loads(ASYNCAPI_SCHEMA.read_text())
    resource = Resource.from_contents(spec, default_specification=DRAFT7)
    registry = Registry().with_resource(spec["$id"], resource).crawl()
    return jsonschema.Draft7Validator(spec, registry=registry)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    out = tmp_path_factory.mktemp("export") / "nested" / "dir"
    return out, export(out)


@pytest.fixture(scope="module")
def doc(exported: tuple[Path, list[Path]]) -> dict[str, Any]:
    out, _ = exported
    loaded: dict[str, Any] = yaml.safe_load((out / "asyncapi.yaml").read_text())
    return loaded


def test_export_writes_one_schema_per_message_and_asyncapi(
    exported: tuple[Path, list[Path]],
) -> None:
    out, paths = exported
    expected = {f"{kind}.schema.json" for kind in MODEL_BY_KIND} | {"asyncapi.yaml"}
    assert {p.name for p in paths} == expected
    assert {p.name for p in out.iterdir()} == expected
    assert all(p.parent == out and p.stat().st_size > 0 for p in paths)


def test_export_is_deterministic(exported: tuple[Path, list[Path]], tmp_path: Path) -> None:
    _, paths = exported
    again = export(tmp_path)
    assert [p.read_bytes() for p in again] == [p.read_bytes() for p in paths]


@pytest.mark.parametrize("model", MESSAGE_MODELS, ids=lambda m: str(m.__name__))
def test_json_schema_is_valid_2020_12_and_matches_the_models(
    exported: tuple[Path, list[Path]], model: Any
) -> None:
    out, _ = exported
    schema = json.loads((out / schema_filename(model)).read_text())
    assert schema["$schema"] == JSON_SCHEMA_DIALECT
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    (example,) = [m for m in examples() if type(m) is model]
    instance = json.loads(encode(example))
    validator.validate(instance)
    # Readers of the schema reject what the models reject: unknown fields, a wrong kind.
    assert not validator.is_valid({**instance, "surprise": 1})
    assert not validator.is_valid({**instance, "kind": "other"})


def test_json_schema_carries_bounds(exported: tuple[Path, list[Path]]) -> None:
    out, _ = exported
    validator = jsonschema.Draft202012Validator(
        json.loads((out / "request.schema.json").read_text())
    )
    good = json.loads(encode(next(iter(examples()))))
    assert validator.is_valid(good)
    assert validator.is_valid({**good, "prompt": "hi", "messages": None})
    for bad in (
        {"max_tokens": 0},
        {"request_id": "has space"},
        {"timeout_s": 0},
        {"prompt": "hi"},  # and messages: prompt or messages, not both
        {"messages": None},  # neither
    ):
        assert not validator.is_valid({**good, **bad}), bad


def test_asyncapi_document_is_valid_3_0_0(doc: dict[str, Any]) -> None:
    errors = sorted(asyncapi_validator().iter_errors(doc), key=lambda e: e.json_path)
    assert [f"{e.json_path}: {e.message[:200]}" for e in errors] == []
    assert doc["asyncapi"] == "3.0.0"
    assert doc["defaultContentType"] == "application/json"
    assert doc["servers"]["local"] == {
        "host": "127.0.0.1:9092",
        "protocol": "kafka",
        "description": doc["servers"]["local"]["description"],
    }


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(d: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        node = d
        for part in parents:
            node = node[part]
        node[last] = value

    return apply


def _drop(path: str) -> Callable[[dict[str, Any]], None]:
    def apply(d: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        node = d
        for part in parents:
            node = node[part]
        del node[last]

    return apply


BREAKAGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "asyncapi-2.6": _set("asyncapi", "2.6.0"),
    "no-info": _drop("info"),
    "action-publish": _set("operations/scheduler.send.assignments/action", "publish"),
    "channel-without-ref": _set("operations/worker.send.events/channel", "llmq.events"),
    "bad-payload-type": _set("components/schemas/Usage/type", "objekt"),
    "unknown-top-level": _set("topics", {}),
    "kafka-partitions-zero": _set("channels/intake/bindings/kafka/partitions", 0),
}


@pytest.mark.parametrize("name", sorted(BREAKAGES))
def test_broken_asyncapi_document_fails_validation(doc: dict[str, Any], name: str) -> None:
    broken = copy.deepcopy(doc)
    BREAKAGES[name](broken)
    assert not asyncapi_validator().is_valid(broken)


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), f"external reference {ref}"
    node: Any = doc
    for part in ref[2:].split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def test_asyncapi_document_is_self_contained(doc: dict[str, Any]) -> None:
    refs = set(_refs(doc))
    assert refs
    for ref in refs:
        _resolve(doc, ref)
    assert "$defs" not in json.dumps(doc)


def test_asyncapi_covers_every_topic_and_message(doc: dict[str, Any]) -> None:
    addresses = {c["address"] for c in doc["channels"].values()}
    assert {s.name for s in catalog()} | {"llmq.replies.{tenant}"} == addresses
    replies = doc["channels"]["replies"]
    assert set(replies["parameters"]) == {"tenant"}
    assert set(replies["messages"]) == {"TokenChunk", "Done", "Error"}
    named = {m["name"] for m in doc["components"]["messages"].values()}
    assert named == {*MODEL_BY_KIND, "deadletter"}
    assert doc["channels"]["heartbeats"]["bindings"]["kafka"]["topicConfiguration"][
        "cleanup.policy"
    ] == ["compact"]


def test_asyncapi_operations_name_their_service(doc: dict[str, Any]) -> None:
    ops = doc["operations"]
    assert ops["scheduler.send.assignments"]["action"] == "send"
    assert ops["worker.receive.assignments"]["action"] == "receive"
    assert ops["worker.send.replies"]["channel"] == {"$ref": "#/channels/replies"}
    only_errors = [m["$ref"] for m in ops["scheduler.send.replies"]["messages"]]
    assert only_errors == ["#/channels/replies/messages/Error"]
    for op in ops.values():
        assert op["tags"][0]["name"] in {t["name"] for t in doc["info"]["tags"]}


def test_asyncapi_operations_are_who_sends_and_reads_what_in_the_code(
    doc: dict[str, Any]
) -> None:
    ops = doc["operations"]
    # The scheduler's own endings; a prefill worker follows the events of its hand-offs.
    assert [m["$ref"].rsplit("/", 1)[1] for m in ops["scheduler.send.events"]["messages"]] \
        == ["EventFailed", "EventAborted"]
    assert {"worker.receive.events", "scheduler.receive.replies", "health.receive.control",
            "client.send.control", "cli.send.control"} <= ops.keys()
    # Drains come from the CLI; nothing in llmq reads the dead letter but an operator.
    assert not {"health.send.control", "cli.receive.deadletter"} & ops.keys()


@pytest.mark.parametrize("model", MESSAGE_MODELS, ids=lambda m: str(m.__name__))
def test_asyncapi_examples_match_payload_schemas(doc: dict[str, Any], model: Any) -> None:
    message = doc["components"]["messages"][model.__name__]
    assert message["name"] == kind_of(model)
    # Payload refs point into components.schemas, so validate from the document's root.
    schema = {"$ref": message["payload"]["$ref"], "components": doc["components"]}
    validator = jsonschema.Draft7Validator(schema)
    for example in message["examples"]:
        validator.validate(example["payload"])
    assert not validator.is_valid({**message["examples"][0]["payload"], "kind": "nope"})


def test_asyncapi_document_function_matches_file(doc: dict[str, Any]) -> None:
    # YAML round trip changes nothing (no tuples, no non-string keys).
    assert json.loads(json.dumps(asyncapi_document())) == doc
