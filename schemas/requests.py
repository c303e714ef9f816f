"""The request on its way in: as submitted, as admitted, as assigned to a worker.

- ``InferenceRequest`` (``kind="request"``, topic ``llmq.intake``): what a client or
  ingest.http submits.
- ``AdmittedRequest`` (``kind="admitted"``, topics ``llmq.requests.<prio>.<lane>``): ingest's
  decision to queue it, with the priority and lane it was given and its token estimate. A
  rejection is not a message of its own: it is a terminal ``Error`` on the reply topic.
- ``Assignment`` (``kind="assignment"``, topic ``llmq.assignments``, partition = worker slot):
  the scheduler's placement, carrying the admitted request verbatim so that a requeue is
  the same message with ``attempt + 1``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from schemas.base import (
    LAX,
    MAX_MESSAGES,
    MAX_PROMPT_CHARS,
    MAX_STOP,
    MAX_STOP_CHARS,
    PREFIX_HASH_PATTERN,
    Attempt,
    Count,
    FrozenModel,
    KvTransfer,
    ModelName,
    Partition,
    PositiveSeconds,
    RequestId,
    ShortName,
    Tenant,
    Timestamp,
    TokenCount,
    TopicName,
    WireMessage,
    WorkerId,
)
from schemas.common import MAX_TOKENS, Lane, Phase, Priority

Role = Literal["system", "user", "assistant", "tool"]


class ChatMessage(FrozenModel):
    """One turn of a chat conversation (OpenAI chat-completions shape, text only)."""

    role: Role = Field(description="Who speaks: system, user, assistant or tool.")
    content: str = Field(
        max_length=MAX_PROMPT_CHARS,
        description="Text of the turn. All turns together are bounded like a prompt.",
    )
    name: ShortName | None = Field(
        default=None, description="Optional participant name, passed through to the engine."
    )


class SamplingParams(FrozenModel):
    """Decoding parameters, passed through to the engine. Defaults follow the OpenAI API."""

    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = Field(
        default=1.0, description="Softmax temperature; 0 means greedy."
    )
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = Field(
        default=1.0, description="Nucleus sampling: keep the smallest set of tokens with this mass."
    )
    top_k: Annotated[int, Field(ge=1, le=100_000)] | None = Field(
        default=None, description="Keep only the k most likely tokens; null disables."
    )
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = Field(
        default=0.0, description="Penalty for tokens that already appeared (OpenAI semantics)."
    )
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = Field(
        default=0.0, description="Penalty proportional to how often a token appeared."
    )
    stop: Annotated[
        tuple[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)], ...], LAX
    ] = Field(
        default=(), max_length=MAX_STOP, description="Stop sequences; generation ends at any."
    )
    seed: Annotated[int, Field(ge=0, le=(1 << 63) - 1)] | None = Field(
        default=None, description="Seed for reproducible sampling; null for a random one."
    )


class InferenceRequest(WireMessage):
    """A completion or chat request as submitted by a client (topic ``llmq.intake``).

    Exactly one of ``prompt`` and ``messages`` is given. ``request_id`` is the idempotency key:
    a resubmission with the same id is the same request.
    """

    # Merged with FrozenModel's config. The extra keyword states "exactly one of prompt and
    # messages" for JSON Schema readers, as the validator below does for pydantic.
    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        }
    )

    kind: Literal["request"] = Field(default="request", description="Message discriminator.")
    request_id: RequestId = Field(description="Client-chosen idempotency key.")
    tenant: Tenant = Field(description="Tenant the request is accounted to (from the API key).")
    model: ModelName = Field(description="Model to serve the request, as the fleet names it.")
    model_version: ShortName | None = Field(
        default=None, description="Pin a model version (revision); null accepts any."
    )
    prompt: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_PROMPT_CHARS,
        description="Completion prompt. Give this or messages, not both.",
    )
    messages: Annotated[tuple[ChatMessage, ...], LAX] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_MESSAGES,
        # Run the validator on the default too, so that "neither given" is caught.
        validate_default=True,
        description="Chat conversation. Give this or prompt, not both.",
    )
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)] = Field(
        description="Most tokens to generate; part of the KV reservation."
    )
    sampling: SamplingParams = Field(default=SamplingParams(), description="Decoding parameters.")
    priority: Priority = Field(
        default="normal", description="Requested priority; admission may lower it."
    )
    lane: Lane | None = Field(
        default=None, description="Lane hint; null lets admission classify by estimated size."
    )
    timeout_s: PositiveSeconds = Field(
        default=600.0,
        description=(
            "End-to-end budget from created_at: queued past it ends with queue_timeout, "
            "running past it is aborted with timeout."
        ),
    )
    reply_to: TopicName | None = Field(
        default=None,
        description="Reply topic; null means {prefix}.replies.{tenant}. Must be authorized.",
    )
    created_at: Timestamp = Field(description="Submission time, Unix seconds.")
    prefix_hash: Annotated[str, Field(pattern=PREFIX_HASH_PATTERN)] | None = Field(
        default=None,
        description="Hash of the shared prompt prefix (lowercase hex), for cache affinity.",
    )

    @field_validator("messages")
    @classmethod
    def _exactly_one_input(
        cls, messages: tuple[ChatMessage, ...] | None, info: ValidationInfo
    ) -> tuple[ChatMessage, ...] | None:
        # A prompt that failed its own checks is absent from info.data; its error is enough.
        if "prompt" not in info.data:
            return messages
        prompt: str | None = info.data["prompt"]
        if (prompt is None) == (messages is None):
            raise ValueError("exactly one of prompt or messages is required")
        if messages is not None:
            total = sum(len(m.content) for m in messages)
            if total > MAX_PROMPT_CHARS:  # "too_long": refused as too_large (413), not invalid
                raise PydanticCustomError(
                    "too_long", "messages hold {total} characters, more than {limit}",
                    {"total": total, "limit": MAX_PROMPT_CHARS},
                )
        return messages

    @property
    def prompt_chars(self) -> int:
        """Characters of input text, prompt or all chat contents."""
        if self.prompt is not None:
            return len(self.prompt)
        return sum(len(m.content) for m in self.messages or ())


class AdmittedRequest(WireMessage):
    """Ingest's decision to queue a request (topics ``llmq.requests.<priority>.<lane>``)."""

    kind: Literal["admitted"] = Field(default="admitted", description="Message discriminator.")
    request: InferenceRequest = Field(description="The request as submitted.")
    priority: Priority = Field(description="Priority it was admitted at; kept across requeues.")
    lane: Lane = Field(description="Lane it was classified into.")
    prompt_tokens: TokenCount = Field(description="Estimated prompt tokens.")
    reply_topic: TopicName = Field(description="Authorized topic for chunks and terminal.")
    admitted_at: Timestamp = Field(description="Admission time, Unix seconds.")

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def total_tokens(self) -> int:
        """Estimated prompt tokens plus max_tokens: the size the lane and KV are based on."""
        return self.prompt_tokens + self.request.max_tokens


class Assignment(WireMessage):
    """The scheduler's placement of an admitted request on one worker.

    Published to the partition of ``llmq.assignments`` that the worker owns. Workers drop an
    assignment whose ``(request_id, attempt)`` they have already seen or superseded.
    """

    kind: Literal["assignment"] = Field(default="assignment", description="Message discriminator.")
    admitted: AdmittedRequest = Field(description="The admitted request, verbatim.")
    worker_id: WorkerId = Field(description="Worker that must run it.")
    partition: Partition = Field(
        description="Partition of the assignments topic owned by that worker."
    )
    attempt: Attempt = Field(description="1 for the first placement, +1 for each requeue.")
    kv_tokens: Annotated[Count, Field(ge=1)] = Field(
        description="KV-cache tokens reserved on the worker (rounded up to blocks)."
    )
    deadline: Timestamp = Field(
        description="Unix seconds after which the worker aborts the request with timeout."
    )
    assigned_at: Timestamp = Field(description="Placement time, Unix seconds.")
    engine_priority: Annotated[int, Field(ge=0, le=2)] | None = Field(
        default=None,
        description="The class the request had aged into when placed (0 high, 1 normal, 2 "
        "low). The worker gives its engine 2 x this + 1 for the long lane as the request "
        "priority (vLLM's, lower first): class first, short before long. None: the "
        "admitted class.",
    )
    worker_started_at: Timestamp | None = Field(
        default=None,
        description="started_at of the worker process the placement was made on (from its "
        "heartbeat). A restarted worker drops assignments stamped for an earlier process: "
        "the scheduler requeues that work, or ends it worker_lost, once it sees the new "
        "process's heartbeat. Null: whichever process holds the slot runs it.",
    )
    phase: Phase = Field(
        default="whole",
        description="What the worker runs: whole (the request), prefill (its prompt only; "
        "nothing goes to the client, event.prefilled reports the KV-transfer parameters) "
        "or decode (its output, from the KV cache the prefill worker computed).",
    )
    kv_transfer: KvTransfer | None = Field(
        default=None,
        description="For a decode stage: the prefill worker's KV-transfer parameters, from "
        "its event.prefilled.",
    )

    @property
    def request(self) -> InferenceRequest:
        return self.admitted.request

    @property
    def request_id(self) -> str:
        return self.admitted.request.request_id
