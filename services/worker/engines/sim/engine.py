"""The live ``sim`` engine: an async wrapper that runs :class:`SimEngineCore` in real time.

One driver task owns the core: it runs a step (``core.step``), sleeps for the step's
duration × ``time_scale`` (1.0 = real time; tests use 0.01 or less to run 100x faster, and
0 runs as fast as the event loop allows), then hands each sequence that sampled a token in
that step one :class:`TokenDelta` through the request's own queue. Continuous batching,
chunked prefill, KV accounting, preemption and the order of waiting requests (by the
request's class with ``scheduling_policy="priority"``, the default, as vLLM's priority
policy; by arrival with ``"fcfs"``) are the core's; this module only adds the clock and
the fan-out.

Time. The core runs on a virtual clock: virtual seconds = real seconds since start ÷
``time_scale``. Steps run back to back in virtual time, and the driver sleeps until the real
instant a step ends; if the event loop was late, the next sleeps are shorter, so the token
rate matches the calibrated model rather than drifting with scheduling jitter.

Text is SIMULATED: each token is a word drawn from a fixed list by an RNG seeded with
``(seed, request_id)``, so a request's output is deterministic and obviously not a model's.
Every sequence generates exactly ``max_tokens`` tokens (``finish_reason = "length"``).

Prefill and decode apart (``GenerateRequest.phase``, ``services.worker.engines.base``), with
a LABELLED FAKE of a KV connector: no KV moves anywhere, only a claim that it did. A
``prefill`` request computes its prompt and samples exactly one token; its final delta
carries ``kv_transfer = {"engine": "sim", "prompt_tokens": P}``. A ``decode`` request with
those parameters goes into the core with ``cached_tokens = P - 1`` (the prompt's KV
"arrived"; the last prompt token is computed here, its logits give the first output
token, as after a vLLM connector's load) and generates its whole ``max_tokens``. The time
a real transfer takes is not modelled. Parameters that are missing, another engine's, or
for another prompt length are refused ``EngineError("worker_lost")``: the fleet's fault,
not the client's (``services.worker.engines.base``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Final

from services.worker.core.rate import RateMeter
from services.worker.engines.base import (
    EngineAborted,
    EngineCapacity,
    EngineError,
    GenerateRequest,
    SchedulingPolicy,
    TokenDelta,
)
from services.worker.engines.sim.model import EngineProfile, SimEngineCore, SimRequest, StepResult

_log = logging.getLogger(__name__)

#: The vocabulary of simulated output (every token is one of these, with a leading space).
WORDS: Final = (
    "the", "queue", "token", "model", "cache", "batch", "worker", "stream", "kafka", "lane",
    "priority", "request", "reply", "engine", "block", "prefill", "decode", "fleet", "tenant",
    "budget", "deadline", "slot", "chunk", "heartbeat", "placement", "admission", "simulated",
    "and", "of", "to", "in", "a", "is", "for", "with", "on", "it", "as", "by", "at",
)


#: ``kv_transfer["engine"]`` of the fake connector's parameters (module docstring).
KV_ENGINE: Final = "sim"


def _cached_tokens(request: GenerateRequest, prompt: int) -> int:
    """Prompt tokens whose KV a ``decode`` request brings (0 for the other phases);
    ``EngineError("worker_lost")`` for parameters this engine cannot have made (the
    fleet's fault, not the client's: the module docstring)."""
    if request.phase != "decode":
        return 0
    params = request.kv_transfer
    if params is None:
        raise EngineError("worker_lost", "a decode request needs kv_transfer (the prefill "
                                         "engine's parameters); it has none")
    if params.get("engine") != KV_ENGINE:
        raise EngineError("worker_lost", f"kv_transfer.engine is {params.get('engine')!r}: "
                                         f"not a {KV_ENGINE} engine's prefill")
    sent = params.get("prompt_tokens")
    if not isinstance(sent, int) or isinstance(sent, bool) or sent != prompt:
        raise EngineError("worker_lost", f"kv_transfer.prompt_tokens is {sent!r}, not the "
                                         f"request's prompt of {prompt} tokens")
    return prompt - 1


class _Stream:
    """One request inside the engine: its sequence id, RNG, the queue it reads, and for a
    prefill the parameters its final delta carries."""

    __slots__ = ("done", "kv_transfer", "prompt_tokens", "queue", "request_id", "rng",
                 "seq_id")

    def __init__(self, request_id: str, seq_id: int, prompt_tokens: int, seed: int,
                 kv_transfer: Mapping[str, object] | None = None) -> None:
        self.request_id = request_id
        self.seq_id = seq_id
        self.prompt_tokens = prompt_tokens
        self.kv_transfer = kv_transfer
        self.rng = random.Random(f"{seed}:{request_id}")
        self.queue: asyncio.Queue[TokenDelta | Exception] = asyncio.Queue()
        self.done = False

    def word(self) -> str:
        return " " + self.rng.choice(WORDS)


class SimEngine:
    """The ``sim`` engine (see the module docstring). Start it before generating."""

    name = "sim"
    disaggregation = True  # with a fake connector (module docstring)

    def __init__(self, profile: EngineProfile, *, time_scale: float = 1.0, seed: int = 0,
                 scheduling_policy: SchedulingPolicy = "priority",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        self.profile = profile
        self.time_scale = time_scale
        self._seed = seed
        self._by_priority = scheduling_policy == "priority"
        self._clock = clock
        self._t0 = clock()
        self._core = SimEngineCore(profile)
        self._streams: dict[str, _Stream] = {}
        self._by_seq: dict[int, _Stream] = {}
        self._seq_ids = itertools.count()
        self._wake = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None
        self._rate = RateMeter()

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        if self._driver is None:
            self._driver = asyncio.create_task(self._drive(), name="sim-engine-driver")

    async def close(self) -> None:
        if self._driver is not None:
            self._driver.cancel()
            # A driver that failed has logged its error and failed its streams already.
            await asyncio.gather(self._driver, return_exceptions=True)
            self._driver = None
        for stream in list(self._streams.values()):
            self._end(stream, EngineAborted("engine closed"))

    # ---- the Engine protocol ---------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        stream = self._admit(request)
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            # Closed early (aclose, cancellation): free the sequence's KV like vLLM would.
            if not stream.done:
                self._end(stream, None)

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self._end(stream, EngineAborted(f"request {request_id} aborted"))

    def capacity(self) -> EngineCapacity:
        """The core's figures; no free KV once the driver died (fail closed: ``_admit``
        refuses everything then)."""
        core, per_token = self._core, self.profile.kv_bytes_per_token
        alive = self._driver is None or not self._driver.done()  # None: not started yet
        free = core.kv_free_tokens if alive else 0
        return EngineCapacity(
            kv_total_tokens=core.kv_total_tokens,
            kv_free_tokens=free,
            kv_total_bytes=core.kv_total_tokens * per_token,
            kv_free_bytes=free * per_token,
            block_size=self.profile.block_size,
            running=core.running,
            waiting=core.waiting,
            max_num_seqs=self.profile.max_num_seqs,
            tokens_per_s=self._rate.rate(self._clock()),
            alive=alive,
        )

    # ---- internals -------------------------------------------------------------------
    def _vnow(self) -> float:
        """Virtual seconds since start (see the module docstring)."""
        elapsed = self._clock() - self._t0
        return elapsed / self.time_scale if self.time_scale > 0 else elapsed

    def _admit(self, request: GenerateRequest) -> _Stream:
        if self._driver is None or self._driver.done():  # never started, or failed
            raise EngineError("worker_lost", "sim engine is not running")
        if request.request_id in self._streams:
            raise EngineError("invalid", f"request {request.request_id} is already running")
        prompt = max(1, request.prompt_tokens)
        prefill = request.phase == "prefill"
        output = 1 if prefill else request.max_tokens  # a prefill samples one token
        if prompt + output > self.profile.max_seq_tokens():
            raise EngineError(
                "too_large",
                f"{prompt} prompt + {output} output tokens exceed the KV cache of "
                f"{self.profile.kv_total_tokens} tokens ({self.profile.name})",
            )
        cached = _cached_tokens(request, prompt)
        kv_transfer = {"engine": KV_ENGINE, "prompt_tokens": prompt} if prefill else None
        stream = _Stream(request.request_id, next(self._seq_ids), prompt, self._seed,
                         kv_transfer)
        priority = request.priority if self._by_priority else 0
        self._core.add(
            SimRequest(stream.seq_id, prompt, output, priority=priority, cached_tokens=cached),
            self._vnow(),
        )
        self._streams[stream.request_id] = stream
        self._by_seq[stream.seq_id] = stream
        self._wake.set()
        return stream

    def _end(self, stream: _Stream, error: Exception | None) -> None:
        """Take a stream out of the engine; ``error`` (if any) is what its reader raises."""
        stream.done = True
        self._streams.pop(stream.request_id, None)
        self._by_seq.pop(stream.seq_id, None)
        self._core.abort(stream.seq_id)  # False when it already finished: fine
        if error is not None:
            stream.queue.put_nowait(error)

    async def _drive(self) -> None:
        try:
            while True:
                if not self._core.has_work:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                start = self._core.next_step_s
                assert start is not None  # has_work
                result = self._core.step(start)
                await self._sleep_until(result.start_s + result.duration_s)
                self._deliver(result)
        except Exception as exc:
            # A bug in the core must not leave readers hanging: fail every stream.
            _log.exception("sim engine driver failed")
            for stream in list(self._streams.values()):
                self._end(stream, EngineError("worker_lost", f"sim engine failed: {exc}"))
            raise

    async def _sleep_until(self, virtual_s: float) -> None:
        if self.time_scale == 0:
            await asyncio.sleep(0)  # let readers and Kafka I/O run between steps
            return
        delay = self._t0 + virtual_s * self.time_scale - self._clock()
        await asyncio.sleep(max(0.0, delay))

    def _deliver(self, result: StepResult) -> None:
        finished = set(result.finished)
        emitted = 0
        for seq_id in result.emitted:
            stream = self._by_seq.get(seq_id)
            if stream is None:
                continue  # aborted while the step ran
            emitted += 1
            if seq_id in finished:
                generated = self._finished_count(result, seq_id)
                stream.queue.put_nowait(TokenDelta(
                    stream.word(), 1, finish_reason="length",
                    prompt_tokens=stream.prompt_tokens, completion_tokens=generated,
                    kv_transfer=stream.kv_transfer,
                ))
                stream.done = True
                self._streams.pop(stream.request_id, None)
                self._by_seq.pop(seq_id, None)
            else:
                stream.queue.put_nowait(TokenDelta(stream.word(), 1))
        self._rate.add(emitted, self._clock())

    @staticmethod
    def _finished_count(result: StepResult, seq_id: int) -> int:
        for event in result.events:
            if event.kind == "finished" and event.seq_id == seq_id:
                return event.generated
        raise AssertionError(f"sequence {seq_id} finished without a finished event")
