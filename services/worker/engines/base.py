"""The one Protocol every inference engine implements, and the plain values it speaks.

The worker app is the only caller. An engine turns a :class:`GenerateRequest` into an async
stream of :class:`TokenDelta` values, aborts a request by id, and reports its
:class:`EngineCapacity` (a cheap, synchronous view: engines that learn their load over the
network refresh it in the background). Nothing here imports Kafka, HTTP or vLLM.

Stream contract (what the worker relies on):

- deltas come in order; ``tokens`` may be 0 for a delta that only carries the finish;
- the last delta has ``finish_reason`` set; a stream that ends without one is an engine
  failure;
- ``abort(request_id)`` ends that request's stream with :class:`EngineAborted` (a no-op for
  unknown or finished ids); closing the iterator early (``aclose``, task cancellation)
  aborts the request too, so the engine frees its KV either way;
- a request the engine cannot run raises :class:`EngineError` with the terminal error code
  the client should get.

Prefill and decode apart (``GenerateRequest.phase``), as vLLM's P/D proxy asks its two
instances; only a worker of role prefill or decode is given these phases, and its engine
must have ``disaggregation`` True (checked at startup):

- ``prefill``: compute the prompt and sample one token (``max_tokens`` is 1), which the
  worker discards — nothing of a prefill stage reaches the client. The stream ends as any
  other, and its final delta also carries ``kv_transfer``: what a decode engine needs to
  take the prompt's KV cache over (vLLM's ``kv_transfer_params``), plain JSON values. A
  prefill stream that ends without it is an engine failure. The engine keeps the KV for
  the decode side to fetch, as its connector does (e.g. until a timeout);
- ``decode``: ``kv_transfer`` holds the prefill's parameters; the engine takes the prompt's
  KV from there instead of computing it and streams the whole output as for ``whole`` (it
  samples every output token itself: the prefill's token is not one of them). Parameters
  it cannot use (missing, malformed, or another engine's) are an :class:`EngineError`
  ``worker_lost``, not ``invalid``: the fleet handed them over, the client did nothing
  wrong, and a retry (retryable, 503) works on a fleet whose stages match.

Note: :class:`EngineCapacity` here is the live load view of an engine; the unrelated
``services.worker.engines.sim.capacity.EngineCapacity`` is the saturated throughput of a
simulated profile (used by benchmarks).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from schemas.common import ErrorCode, Phase

FinishReason = Literal["stop", "length"]
#: How an engine orders the requests it has not started: by ``GenerateRequest.priority``
#: (then arrival), or by arrival alone. vLLM's ``--scheduling-policy``.
SchedulingPolicy = Literal["priority", "fcfs"]


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One chat message as the engine sees it (role and text)."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """What an engine is asked to generate. ``request_id`` is unique per attempt on a worker.

    Exactly one of ``prompt`` and ``messages`` is set. ``prompt_tokens`` is admission's
    estimate (the ``sim`` engine uses it as the prompt length; real engines count their own).
    ``phase`` and ``kv_transfer``: prefill and decode apart (module docstring).
    """

    request_id: str
    model: str
    max_tokens: int
    prompt_tokens: int
    prompt: str | None = None
    messages: tuple[ChatTurn, ...] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    #: ``schemas.common.engine_rank`` of the request's class and lane (0 = high short …
    #: 5 = low long). Engines that schedule by priority (vLLM's ``--scheduling-policy
    #: priority``: lower first) use it; FCFS ignores it.
    priority: int = 0
    #: ``whole`` (the request), ``prefill`` (its prompt, one token sampled and discarded) or
    #: ``decode`` (its output, from the KV cache a prefill engine computed).
    phase: Phase = "whole"
    #: For ``decode``: the prefill engine's KV-transfer parameters (its final delta's).
    kv_transfer: Mapping[str, object] | None = None


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New output of one request: ``text`` made of ``tokens`` tokens.

    The final delta carries ``finish_reason``, and where the engine knows them the
    authoritative ``prompt_tokens`` / ``completion_tokens`` of the whole request; the final
    delta of a ``prefill`` request also ``kv_transfer``, the parameters its decode stage's
    engine needs (module docstring).
    """

    text: str
    tokens: int
    finish_reason: FinishReason | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    kv_transfer: Mapping[str, object] | None = None


@dataclass(frozen=True, slots=True)
class EngineCapacity:
    """An engine's load and capacity now. KV in tokens and bytes; VRAM in bytes (0/0 when
    the engine does not know it); ``gpu_util`` in [0, 1] or None. ``alive`` is False once
    the engine died and can run nothing more: fail closed, it then reports no free KV, and
    the worker exits so that the scheduler declares it lost."""

    kv_total_tokens: int
    kv_free_tokens: int
    kv_total_bytes: int
    kv_free_bytes: int
    block_size: int
    running: int
    waiting: int
    max_num_seqs: int
    vram_total_bytes: int = 0
    vram_used_bytes: int = 0
    gpu_util: float | None = None
    tokens_per_s: float = 0.0
    alive: bool = True


class EngineError(Exception):
    """The engine cannot run a request; ``code`` is the terminal error the client gets."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message


class EngineMisconfigured(Exception):
    """The engine's server is not the one the worker was configured for (a wrong URL or
    model): ``start`` refuses, with a one-line message saying what to fix."""


class EngineAborted(Exception):
    """The request's stream ended because ``abort(request_id)`` was called."""


@runtime_checkable
class Engine(Protocol):
    """An inference engine behind one worker."""

    #: Engine kind as heartbeats report it: ``sim``, ``vllm``, ``openai``.
    name: str
    #: Whether it runs ``prefill`` and ``decode`` requests (module docstring); a worker
    #: with role prefill or decode needs an engine that does.
    disaggregation: bool

    async def start(self) -> None:
        """Load the model / open connections; ready to generate when it returns."""

    async def close(self) -> None:
        """Stop and free everything; requests still streaming end with EngineAborted."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Stream the output of ``request`` (see the module docstring for the contract)."""
        ...

    async def abort(self, request_id: str) -> None:
        """End ``request_id``'s stream and free its resources; no-op if unknown."""

    def capacity(self) -> EngineCapacity:
        """The current load view (cheap; no I/O)."""
        ...
