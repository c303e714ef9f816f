"""Export the wire contract for people and tools outside Python.

``export(out_dir)`` writes one JSON Schema (draft 2020-12) per message, named
``<kind>.schema.json``, and ``asyncapi.yaml``, an AsyncAPI 3.0.0 document of every topic:
channels (the reply channel parameterised by tenant), send/receive operations per service,
and messages whose payloads are the same schemas, gathered under ``components.schemas`` so the
document is self-contained. Everything is generated from the models and the topic catalog;
nothing here is written by hand twice. The CLI (``llmq schema export --out DIR``) calls it.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any, Final

import yaml
from pydantic.json_schema import models_json_schema

from schemas.base import WireMessage
from schemas.common import SCHEMA_VERSION
from schemas.examples import examples
from schemas.messages import MESSAGE_MODELS, kind_of
from schemas.topics import (
    DEADLETTER_FIELD_HEADER,
    DEADLETTER_REASON_HEADER,
    DEADLETTER_SOURCE_HEADER,
    KEY_FIELD,
    TopicSpec,
    catalog,
    reply_spec,
)

JSON_SCHEMA_DIALECT: Final = "https://json-schema.org/draft/2020-12/schema"
_KAFKA_BINDING: Final = "0.5.0"
_COMPONENT_REF: Final = "#/components/schemas/{model}"

_SERVICES: Final = {
    "client": "Applications that submit requests over Kafka and read replies.",
    "ingest": "API keys, validation, rate limits, lane classification (services/ingest).",
    "scheduler": "Pending queue, placement, KV reservations, deadlines (services/scheduler).",
    "worker": "One engine, its assignments partition, streaming (services/worker).",
    "health": "Consul registration, drain, cluster status (services/health).",
    "cli": "The llmq command line (drain, status, submit).",
}

#: Producers that send only some of a channel's messages: (channel id, service) -> messages.
_SENDS_ONLY: Final[dict[tuple[str, str], tuple[str, ...]]] = {
    ("replies", "scheduler"): ("Error",),  # queue_timeout, worker_lost
    ("replies", "ingest"): ("Error",),  # rejections
    ("control", "cli"): ("DrainWorker",),
    ("control", "client"): ("CancelRequest",),
    ("control", "ingest"): ("CancelRequest",),  # client disconnects
    ("control", "scheduler"): ("LeaseAnswer",),
    ("events", "scheduler"): ("EventFailed", "EventAborted"),  # its own endings
}

_TRACE_HEADERS: Final = {
    "type": "object",
    "description": "Kafka record headers every llmq message carries (W3C trace context).",
    "properties": {
        "traceparent": {
            "type": "string",
            "pattern": "^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$",
            "description": "W3C traceparent of the span that produced the record.",
        },
        "tracestate": {"type": "string", "description": "W3C tracestate, when present."},
    },
}

_DEADLETTER_HEADERS: Final = {
    "type": "object",
    "description": "Why the record was dead-lettered, and where it came from.",
    "properties": {
        DEADLETTER_REASON_HEADER: {"type": "string", "description": "Decode or processing error."},
        DEADLETTER_FIELD_HEADER: {
            "type": "string",
            "description": "Dotted path of the first failing field; empty for the whole record.",
        },
        DEADLETTER_SOURCE_HEADER: {
            "type": "string",
            "description": "Origin of the record as topic/partition/offset.",
        },
    },
}


def json_schema(model: type[WireMessage]) -> dict[str, Any]:
    """Draft 2020-12 JSON Schema of one message (validation mode: what a reader accepts)."""
    return {"$schema": JSON_SCHEMA_DIALECT, **model.model_json_schema()}


def schema_filename(model: type[WireMessage]) -> str:
    return f"{kind_of(model)}.schema.json"


def export(out_dir: Path, prefix: str = "llmq", assignment_partitions: int = 16) -> list[Path]:
    """Write every message's JSON Schema and ``asyncapi.yaml`` into ``out_dir``.

    Creates ``out_dir`` if needed and overwrites earlier exports. Returns the written paths.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for model in MESSAGE_MODELS:
        path = out_dir / schema_filename(model)
        path.write_text(json.dumps(json_schema(model), indent=2, ensure_ascii=False) + "\n")
        written.append(path)
    doc = asyncapi_document(prefix, assignment_partitions)
    path = out_dir / "asyncapi.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=100))
    written.append(path)
    return written


def asyncapi_document(prefix: str = "llmq", assignment_partitions: int = 16) -> dict[str, Any]:
    """The AsyncAPI 3.0.0 document of all topics, as plain data ready for YAML or JSON."""
    specs = catalog(prefix, assignment_partitions)
    replies = reply_spec(prefix, "tenant")
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for spec in [*specs, replies]:
        cid = spec.name.removeprefix(f"{prefix}.")
        if spec is replies:
            cid = "replies"
        channels[cid] = _channel(spec, prefix, cid)
        operations.update(_operations(spec, cid, channels[cid]))
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "llmq",
            "version": f"{SCHEMA_VERSION}.0.0",
            "description": (
                "Queue governance for LLM inference fleets: the Kafka topics between clients, "
                f"ingest, scheduler and workers. Every message carries kind and schema_version "
                f"(readers accept versions up to {SCHEMA_VERSION})."
            ),
            "license": {"name": "Apache-2.0"},
            "tags": [{"name": name, "description": text} for name, text in _SERVICES.items()],
        },
        "defaultContentType": "application/json",
        "servers": {
            "local": {
                "host": "127.0.0.1:9092",
                "protocol": "kafka",
                "description": "Single-node KRaft broker started by the project's infra script.",
            }
        },
        "channels": channels,
        "operations": operations,
        "components": {
            "schemas": _component_schemas(),
            "messages": _component_messages(),
        },
    }


def _channel(spec: TopicSpec, prefix: str, cid: str) -> dict[str, Any]:
    names = [m.__name__ for m in spec.models] or ["DeadLetter"]
    channel: dict[str, Any] = {
        "address": spec.name,
        "title": cid,
        "description": f"{spec.description} Key: {spec.key or 'none'}.",
        "messages": {n: {"$ref": f"#/components/messages/{n}"} for n in names},
        "bindings": {
            "kafka": {
                "partitions": spec.partitions,
                "topicConfiguration": {
                    "cleanup.policy": [spec.cleanup_policy],
                    **dict(spec.configs),
                },
                "bindingVersion": _KAFKA_BINDING,
            }
        },
    }
    if cid == "replies":
        channel["address"] = f"{prefix}.replies.{{tenant}}"
        channel["parameters"] = {
            "tenant": {
                "description": "Tenant the replies belong to (letters, digits, _ and -).",
                "examples": ["acme"],
            }
        }
    return channel


def _operations(spec: TopicSpec, cid: str, channel: dict[str, Any]) -> dict[str, Any]:
    ops: dict[str, Any] = {}
    for action, services in (("send", spec.producers), ("receive", spec.consumers)):
        for service in services:
            names = tuple(channel["messages"])
            if action == "send":
                names = _SENDS_ONLY.get((cid, service), names)
            verb = "publishes to" if action == "send" else "consumes"
            ops[f"{service}.{action}.{cid}"] = {
                "action": action,
                "channel": {"$ref": f"#/channels/{cid}"},
                "summary": f"{service} {verb} {channel['address']}",
                "messages": [{"$ref": f"#/channels/{cid}/messages/{n}"} for n in names],
                "tags": [{"name": service}],
            }
    return ops


def _component_schemas() -> dict[str, Any]:
    _, top = models_json_schema(
        [(m, "validation") for m in MESSAGE_MODELS], ref_template=_COMPONENT_REF
    )
    schemas = {name: _to_asyncapi_schema(s) for name, s in top.get("$defs", {}).items()}
    schemas["TraceHeaders"] = _TRACE_HEADERS
    schemas["DeadLetterHeaders"] = _DEADLETTER_HEADERS
    return schemas


def _to_asyncapi_schema(node: Any) -> Any:
    """Adapt pydantic's output to the AsyncAPI Schema Object (a draft-07 superset).

    pydantic writes OpenAPI-style ``discriminator`` objects for unions; AsyncAPI wants the
    property name as a string. Nothing else differs for the keywords our models produce.
    """
    if isinstance(node, dict):
        out = {k: _to_asyncapi_schema(v) for k, v in node.items()}
        if isinstance(out.get("discriminator"), dict):
            out["discriminator"] = out["discriminator"]["propertyName"]
        return out
    if isinstance(node, list):
        return [_to_asyncapi_schema(v) for v in node]
    return node


def _component_messages() -> dict[str, Any]:
    example_of = {type(m): m for m in examples()}
    messages: dict[str, Any] = {}
    for model in MESSAGE_MODELS:
        name = model.__name__
        messages[name] = {
            "name": kind_of(model),
            "title": name,
            "summary": (inspect.getdoc(model) or name).splitlines()[0],
            "contentType": "application/json",
            "headers": {"$ref": "#/components/schemas/TraceHeaders"},
            "payload": {"$ref": _COMPONENT_REF.format(model=name)},
            "bindings": {
                "kafka": {
                    "key": {
                        "type": "string",
                        "description": f"The message's {KEY_FIELD[model]}, UTF-8.",
                    },
                    "bindingVersion": _KAFKA_BINDING,
                }
            },
            "examples": [{"name": "example", "payload": example_of[model].model_dump(mode="json")}],
        }
    messages["DeadLetter"] = {
        "name": "deadletter",
        "title": "DeadLetter",
        "summary": "A record that could not be decoded or processed, value unchanged.",
        "contentType": "application/octet-stream",
        "headers": {"$ref": "#/components/schemas/DeadLetterHeaders"},
        "payload": {"description": "The original record value, byte for byte."},
    }
    return messages
