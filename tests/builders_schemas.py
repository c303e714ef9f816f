"""Builders of wire messages for tests: valid by default, override what the test is about.

``sample_messages()`` gives one valid instance of every message kind (the broker round trip
reuses it); ``make_*`` return a validated copy of the canonical example with fields replaced,
so an invalid override fails where it is written.
"""

from __future__ import annotations

from typing import Any

from schemas.base import WireMessage
from schemas.control import CancelRequest, DrainWorker
from schemas.examples import (
    example_admitted,
    example_assignment,
    example_heartbeat,
    example_request,
    examples,
)
from schemas.messages import kind_of
from schemas.replies import Done, Error, TokenChunk
from schemas.requests import AdmittedRequest, Assignment, InferenceRequest
from schemas.workers import WorkerHeartbeat


def sample_messages() -> list[WireMessage]:
    """One valid instance of every message kind, in the order of ``MESSAGE_MODELS``."""
    return list(examples())


def make_message(kind: str, **changes: Any) -> WireMessage:
    """The example of ``kind`` with ``changes`` applied."""
    for msg in examples():
        if kind_of(type(msg)) == kind:
            return msg.evolve(**changes)
    raise KeyError(kind)


def make_request(**changes: Any) -> InferenceRequest:
    return example_request().evolve(**changes)


def make_prompt_request(prompt: str = "Once upon a time", **changes: Any) -> InferenceRequest:
    return example_request().evolve(prompt=prompt, messages=None, **changes)


def make_admitted(**changes: Any) -> AdmittedRequest:
    return example_admitted().evolve(**changes)


def make_assignment(**changes: Any) -> Assignment:
    return example_assignment().evolve(**changes)


def make_heartbeat(**changes: Any) -> WorkerHeartbeat:
    return example_heartbeat().evolve(**changes)


def make_chunk(**changes: Any) -> TokenChunk:
    msg = make_message("chunk", **changes)
    assert isinstance(msg, TokenChunk)
    return msg


def make_done(**changes: Any) -> Done:
    msg = make_message("done", **changes)
    assert isinstance(msg, Done)
    return msg


def make_error(**changes: Any) -> Error:
    msg = make_message("error", **changes)
    assert isinstance(msg, Error)
    return msg


def make_drain(**changes: Any) -> DrainWorker:
    msg = make_message("drain", **changes)
    assert isinstance(msg, DrainWorker)
    return msg


def make_cancel(**changes: Any) -> CancelRequest:
    msg = make_message("cancel", **changes)
    assert isinstance(msg, CancelRequest)
    return msg
