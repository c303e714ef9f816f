"""The ``openai`` engine: an external vLLM (or any OpenAI-compatible) server over HTTP.

Generation streams from ``POST /v1/completions`` (or ``/v1/chat/completions`` for chat
requests) with ``stream=true`` and ``stream_options`` ``include_usage`` and
``continuous_usage_stats`` (a vLLM extension: every chunk carries the cumulative
``usage.completion_tokens``; a server that refuses the field with a 400/422 naming it gets
the request again without it, and no later request carries it). Each server-sent
``data:`` event carrying text is one delta; its tokens are the growth of
``completion_tokens`` when the event carries usage (vLLM merges several tokens into one
chunk under load, with speculative decoding or ``--stream-interval``), else one. Tokens
the deltas did not account for (chunks without text, a server without
``continuous_usage_stats``) go on the last delta, from the final usage event. ``data:
[DONE]`` ends the stream. vLLM's ``finish_reason`` ``"error"`` (a request-level failure in
the server) ends the request ``worker_lost``; ``"repetition"`` is a stop. Aborting closes the
HTTP stream, which makes vLLM abort the request and free its KV. A 400 that says the prompt
is over the model's length is ``too_large``, as the in-process ``vllm`` engine answers it.

Every stream holds one HTTP connection, so the streaming client has no connection limit (the
worker bounds its requests in flight); ``/metrics`` has its own client, so a full pool of
streams never starves the capacity scrape.

Capacity comes from the server's Prometheus ``/metrics``, polled every
``metrics_interval_s`` in the background (vLLM names, summed over engines):
``vllm:kv_cache_usage_perc`` (fraction 0..1; older vLLM: ``vllm:gpu_cache_usage_perc``),
``vllm:num_requests_running``, ``vllm:num_requests_waiting``, and the pool size from the
labels of ``vllm:cache_config_info`` (``num_gpu_blocks``, ``block_size``) when exposed, else
the profile's. KV bytes per token come from the profile (the server does not publish them).

Priorities: vLLM's OpenAI server takes a request ``priority`` only when it runs
``--scheduling-policy priority`` (and refuses non-zero values otherwise), and other
servers may refuse the field, so this engine sends it only with ``scheduling_policy =
"priority"`` — its default is ``fcfs``.

Unknown state fails closed (STYLE.md §6): while ``/metrics`` cannot be read (server down,
5xx, a value that is not a finite number, any failure of the scrape) the engine reports no
free KV, so the scheduler sends nothing; the background poll keeps trying. A server without a
``/metrics`` endpoint at all (404) is accounted locally instead: free KV = pool − Σ (prompt +
max tokens) of the requests in flight.

Prefill and decode apart (``GenerateRequest.phase``): vLLM's P/D protocol, as its proxy
(``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``) speaks it to two servers
started with a KV connector (``--kv-transfer-config``, e.g. ``NixlConnector``). A
``prefill`` request is one non-streaming ``POST`` of the same body with ``max_tokens: 1``,
``stream: false``, no ``stream_options`` and ``kv_transfer_params`` ``{"do_remote_decode":
true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null,
"remote_host": null, "remote_port": null}``, and a fresh ``X-Request-Id`` header (a UUID, as
the proxy makes). Unlike the proxy it also sends ``ignore_eos: true`` and no ``stop``:
vLLM's connectors hand the KV on only for a prefill that ended at its length cap, and the
one token it samples is discarded anyway. Aborting a prefill cancels its request: the
connection closes, and vLLM aborts a request whose client went away. A ``decode`` request
is the usual stream with the prefill's ``kv_transfer_params`` and the prefill's
``X-Request-Id`` header.

The two stages run on two workers, and the decode worker knows only the ``kv_transfer``
mapping the prefill worker reported (``event.prefilled``, then the decode stage's
assignment), so the prefill's final delta carries both values in an llmq envelope owned
by this engine::

    {"engine": "openai",                      # whose envelope it is
     "kv_transfer_params": {...},             # the prefill server's answer, as it is
     "x_request_id": "<the prefill's X-Request-Id>"}

and a decode request unwraps it. The shared header is what the proxy sends both servers:
some vLLM/NixlConnector versions pair the stages by it (the decode side tells the prefill
side it is done by its own request id, and without a shared one the prefill server keeps
the blocks until its hold runs out: ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, or in recent
versions the connector's ``kv_lease_duration``); newer ones also put the prefill's
id in the parameters (``remote_request_id``). Parameters with ``remote_engine_id`` but no
``remote_request_id`` (an older vLLM: pairing by the header only) are logged once.

Failures of the two stages, and whose fault they are:

- A prefill answer without ``kv_transfer_params`` means a server without a KV connector:
  that request fails ``worker_lost``, and so would every prefill placed here, so the engine
  reports itself dead (``capacity().alive`` False, with one error log line): the worker
  exits, the scheduler declares it lost and requeues its work elsewhere. Requests that
  come after that are refused ``worker_lost``.
- A decode request whose ``kv_transfer`` is missing or not this engine's envelope (another
  engine's prefill) is refused ``worker_lost`` before anything is sent: the fleet's fault,
  not the client's, and a retry would work on a sane fleet. For the same reason a 400/422
  answer to a decode request is ``worker_lost`` (its body passed the prefill server
  already, so what the decode server refuses is the hand-off), unless it says the prompt
  is over the model's length (``too_large``, as for any request).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

import httpx
from prometheus_client.parser import text_string_to_metric_families

from schemas.common import MAX_TOKENS, ErrorCode, Phase
from services.worker.core.rate import RateMeter
from services.worker.engines.base import (
    EngineAborted,
    EngineCapacity,
    EngineError,
    EngineMisconfigured,
    FinishReason,
    GenerateRequest,
    SchedulingPolicy,
    TokenDelta,
)
from services.worker.engines.sim.model import EngineProfile
from services.worker.engines.vllm import says_prompt_too_long

_log = logging.getLogger(__name__)

_KV_USAGE: Final = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_RUNNING: Final = "vllm:num_requests_running"
_WAITING: Final = "vllm:num_requests_waiting"
_CACHE_INFO: Final = "vllm:cache_config_info"
#: A prefill stage's ``kv_transfer_params``: keep the prompt's KV for a remote decode.
PREFILL_KV_PARAMS: Final[dict[str, Any]] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}
#: ``kv_transfer["engine"]`` of this engine's envelope (module docstring).
KV_ENGINE: Final = "openai"
#: The header both stages of a request are sent with (vLLM's proxy's).
REQUEST_ID_HEADER: Final = "X-Request-Id"


@dataclass(frozen=True, slots=True)
class Handoff:
    """What a prefill stage hands its decode stage: the prefill server's
    ``kv_transfer_params`` and the ``X-Request-Id`` both stages are sent with (module
    docstring); :meth:`envelope` is its ``kv_transfer`` on the wire."""

    params: Mapping[str, Any]
    x_request_id: str

    def envelope(self) -> dict[str, object]:
        return {"engine": KV_ENGINE, "kv_transfer_params": dict(self.params),
                "x_request_id": self.x_request_id}

    @classmethod
    def of(cls, kv_transfer: Mapping[str, object] | None) -> Handoff:
        """A decode request's ``kv_transfer`` unwrapped; ``EngineError("worker_lost")``
        when it is missing or not this engine's envelope (the fleet's fault, not the
        client's: module docstring)."""
        if not kv_transfer:
            raise EngineError("worker_lost", "a decode request needs kv_transfer (the "
                                             "prefill engine's parameters); it has none")
        if kv_transfer.get("engine") != KV_ENGINE:
            raise EngineError("worker_lost", f"kv_transfer.engine is "
                              f"{kv_transfer.get('engine')!r}: not an {KV_ENGINE} engine's "
                              "prefill")
        params = kv_transfer.get("kv_transfer_params")
        if not isinstance(params, Mapping) or not params:
            raise EngineError("worker_lost", "kv_transfer.kv_transfer_params is not the "
                                             f"prefill server's parameters: {params!r:.200}")
        rid = kv_transfer.get("x_request_id")
        if not (isinstance(rid, str) and 0 < len(rid) <= 256 and rid.isascii()
                and rid.isprintable()):
            raise EngineError("worker_lost", "kv_transfer.x_request_id is not a request id: "
                                             f"{rid!r:.200}")
        return cls(params, rid)


@dataclass(frozen=True, slots=True)
class ServerLoad:
    """What one /metrics scrape said. ``kv_usage`` in [0, 1]; pool size when published."""

    kv_usage: float | None
    running: int
    waiting: int
    num_gpu_blocks: int | None = None
    block_size: int | None = None


#: Largest value of a count read from /metrics (running, waiting: per sample) and of the
#: KV pool (blocks, over all engines): past these a value is not a real server's, and the
#: heartbeat could not carry the sizes made from it (``Count``, ``kv_total_bytes``).
_MAX_SEQS: Final = 1 << 31
_MAX_GPU_BLOCKS: Final = 1 << 24
#: The wire's largest block size (``WorkerHeartbeat.block_size``).
_MAX_BLOCK_SIZE: Final = 1 << 16


def parse_vllm_metrics(text: str) -> ServerLoad:
    """Parse a Prometheus text exposition of a vLLM server (see the module docstring).

    A data-parallel server labels each engine's samples ``engine``: the pool is the sum of
    the engines' ``num_gpu_blocks``, and the usage their mean weighted by those blocks
    (unweighted when an engine's pool is not published).

    Raises ``ValueError`` for text that is not an exposition, and for a value of a metric
    read here that no real server reports (NaN, infinite, negative, or past
    :data:`_MAX_SEQS`, :data:`_MAX_GPU_BLOCKS`, :data:`_MAX_BLOCK_SIZE`): the load is then
    unknown (fail closed), not "all free" nor a heartbeat the wire refuses.
    """
    usage: dict[str, float] = {}
    blocks: dict[str, int] = {}
    running = waiting = 0
    block_size: int | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, value = sample.name, sample.value
            engine = sample.labels.get("engine", "")
            if name in (*_KV_USAGE, _RUNNING, _WAITING) and not math.isfinite(value):
                raise ValueError(f"{name} is {value}")
            if name in _KV_USAGE:
                usage[engine] = min(1.0, max(0.0, float(value)))
            elif name in (_RUNNING, _WAITING):
                if not 0 <= value <= _MAX_SEQS:
                    raise ValueError(f"{name} is {value}, not a count of requests")
                if name == _RUNNING:
                    running += int(value)
                else:
                    waiting += int(value)
            elif name == _CACHE_INFO:
                n = _int_label(sample.labels, "num_gpu_blocks")
                if n is not None:
                    blocks[engine] = n
                size = _int_label(sample.labels, "block_size")
                if size is not None and size > _MAX_BLOCK_SIZE:
                    raise ValueError(f"{name} block_size is {size}, over {_MAX_BLOCK_SIZE}")
                block_size = size or block_size
    pool = sum(blocks.values()) or None
    if pool is not None and pool > _MAX_GPU_BLOCKS:
        raise ValueError(f"{_CACHE_INFO} num_gpu_blocks sum to {pool}, over {_MAX_GPU_BLOCKS}")
    kv: float | None = None
    if usage and all(blocks.get(e) for e in usage):
        weight = sum(blocks[e] for e in usage)
        kv = sum(u * blocks[e] for e, u in usage.items()) / weight
    elif usage:
        kv = sum(usage.values()) / len(usage)
    return ServerLoad(None if kv is None else min(1.0, max(0.0, kv)), running, waiting,
                      pool, block_size)


def _int_label(labels: dict[str, str], name: str) -> int | None:
    raw = labels.get(name, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def _status_code(status: int, body: str, phase: Phase = "whole") -> ErrorCode:
    """Terminal error code for an HTTP error from the server, whose answer is ``body``, to
    a request of ``phase``."""
    if status == 404:
        return "unknown_model"
    if status == 413:
        return "too_large"
    if status in (400, 422):
        # vLLM refuses a prompt over max_model_len with a 400 that says so.
        if says_prompt_too_long(body):
            return "too_large"
        # A decode's body passed the prefill server: what is refused is the hand-off.
        return "worker_lost" if phase == "decode" else "invalid"
    if status in (429, 503):
        return "overloaded"
    return "worker_lost"


def _finish(reason: object) -> FinishReason | None:
    """The server's ``finish_reason`` as ours; None while unfinished or for an abort.

    Raises ``EngineError`` for vLLM's ``"error"``: a request-level failure inside the server
    (e.g. a KV load), which vLLM answers 500 outside a stream, not an answer the model ended.
    """
    if reason == "error":
        raise EngineError("worker_lost", "engine server ended the request with an error")
    if reason == "length":
        return "length"
    # stop, repetition, eos, content_filter, tool_calls: the model ended the answer itself.
    return None if reason in (None, "abort") else "stop"


async def _refuses_usage_stats(response: httpx.Response) -> bool:
    """A 400/422 naming ``continuous_usage_stats``: a server that validates
    ``stream_options`` strictly (OpenAI's own API, some gateways) and lacks vLLM's
    extension."""
    if response.status_code not in (400, 422):
        return False
    try:
        error = json.loads(await response.aread())
    except ValueError:
        return False
    # The error's own text, not the whole body: a 422 that echoes the request would name
    # the field whatever went wrong.
    # OpenAI nests it ({"error": {...}}), FastAPI says "detail", vLLM's older servers and
    # their kin put message/param/code at the top level.
    detail = error.get("error", error.get("detail", error)) if isinstance(error, dict) else None
    if isinstance(detail, dict):
        detail = " ".join(str(detail.get(k, "")) for k in ("message", "param", "code"))
    elif isinstance(detail, list):  # FastAPI/pydantic: [{"loc": [...], "msg": ...}, ...]
        detail = " ".join(str(d.get("loc", "")) + str(d.get("msg", ""))
                          for d in detail if isinstance(d, dict))
    return "continuous_usage_stats" in str(detail)


def request_body(
    req: GenerateRequest, served_model: str, *, priority: bool = False,
    continuous_usage: bool = True,
) -> tuple[str, dict[str, Any]]:
    """Path and JSON body of the request for ``req``: streaming, or for a prefill stage the
    non-streaming one of the module docstring; a decode stage's carries the prefill's
    ``kv_transfer_params`` (unwrapped from its envelope: :meth:`Handoff.of`, which raises
    for one that is not this engine's). With ``priority``, the request's ``priority``
    (class, then lane) as vLLM's ``priority`` field (a vLLM extension, accepted only by a
    server started with ``--scheduling-policy priority``; it refuses non-zero values
    otherwise, so it is sent only when the worker is told the server schedules by it)."""
    body: dict[str, Any] = {
        "model": served_model,
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if continuous_usage:
        body["stream_options"]["continuous_usage_stats"] = True
    if req.stop:
        body["stop"] = list(req.stop)
    if req.seed is not None:
        body["seed"] = req.seed
    if req.top_k is not None:
        body["top_k"] = req.top_k  # a vLLM extension; OpenAI itself has no top_k
    if priority:
        body["priority"] = req.priority
    if req.phase == "prefill":
        body.update(max_tokens=1, stream=False, ignore_eos=True,
                    kv_transfer_params=dict(PREFILL_KV_PARAMS))
        del body["stream_options"]  # vLLM refuses them without stream
        body.pop("stop", None)
    elif req.phase == "decode":
        body["kv_transfer_params"] = dict(Handoff.of(req.kv_transfer).params)
    if req.messages is not None:
        body["messages"] = [{"role": m.role, "content": m.content} for m in req.messages]
        return "/v1/chat/completions", body
    body["prompt"] = req.prompt or ""
    return "/v1/completions", body


class _Tally:
    """Running totals of one stream."""

    def __init__(self) -> None:
        self.tokens = 0  # given to the deltas so far
        self.finish: FinishReason | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None  # cumulative, as the server last said
        #: The first half of a UTF-16 surrogate pair that ended an event's text (a server
        #: that slices strings by UTF-16 unit splits an emoji so), held for the next one,
        #: and the tokens of events held whole (counted one each when usage is absent).
        self.held = ""
        self.held_tokens = 0

    def take(self, event: dict[str, Any]) -> TokenDelta | None:
        """Account one SSE event; the delta to yield, if it carries text."""
        usage = event.get("usage")
        reported: int | None = None
        if isinstance(usage, dict):
            self.prompt_tokens = _opt_int(usage.get("prompt_tokens"))
            reported = self.completion_tokens = _opt_int(usage.get("completion_tokens"))
        choices = event.get("choices") or []
        if not choices or not isinstance(choices[0], dict):
            return None
        choice = choices[0]
        delta = choice.get("delta")
        text = choice.get("text") if delta is None else (delta or {}).get("content")
        reason = _finish(choice.get("finish_reason"))
        if reason is not None:
            self.finish = reason
        if not (isinstance(text, str) and text):
            return None  # its tokens, if any, go on the next delta (usage is cumulative)
        text, self.held = self.held + text, ""
        if "\ud800" <= text[-1] <= "\udbff":  # its low half comes with the next event
            text, self.held = text[:-1], text[-1]
            if not text:
                self.held_tokens += 1 if reported is None else 0
                return None
        tokens = (1 + self.held_tokens) if reported is None else max(0, reported - self.tokens)
        self.held_tokens = 0
        self.tokens += tokens
        return TokenDelta(text, tokens)

    def last(self) -> TokenDelta:
        """The finishing delta, with the tokens the server counted that no delta carried."""
        if self.finish is None:
            raise EngineError("worker_lost", "stream ended without a finish reason")
        rest = max(0, (self.completion_tokens or 0) - self.tokens)
        if self.completion_tokens is None:
            rest = self.held_tokens
        # A half pair never completed stays in the text (the run makes it U+FFFD).
        return TokenDelta(self.held, rest, finish_reason=self.finish,
                          prompt_tokens=self.prompt_tokens,
                          completion_tokens=self.completion_tokens)


def _opt_int(value: object) -> int | None:
    """A token count the server reported, or None when it is not one the wire takes (not
    an int, negative, past ``MAX_TOKENS``): the run then counts for itself."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKENS:
        return value
    return None


class NoKvConnector(EngineError):
    """A prefill answer without ``kv_transfer_params``: the server has no KV connector, so
    every prefill sent there fails the same way (the engine reports itself dead)."""


def prefill_delta(answer: object, x_request_id: str) -> TokenDelta:
    """The final (and only) delta of a prefill stage from the server's JSON ``answer`` to
    the request sent with ``x_request_id``, carrying both as :class:`Handoff`'s envelope
    (module docstring). :class:`NoKvConnector` when the answer has no
    ``kv_transfer_params``, ``EngineError`` when it is not an answer."""
    if not isinstance(answer, dict):
        raise EngineError("worker_lost", f"engine server's prefill answer is not an object: "
                                         f"{str(answer)[:200]}")
    choices = answer.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices \
        and isinstance(choices[0], dict) else {}
    reason = choice.get("finish_reason")
    _finish(reason)  # vLLM's "error" fails the request here too
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict) or not params:
        ended = "" if reason in (None, "length") else (
            f"; or the prefill ended {reason!r}, not at its 1-token cap (vLLM's connectors "
            "hand the KV on only then)")
        raise NoKvConnector("worker_lost", "engine server answered the prefill without "
                          "kv_transfer_params: it has no KV connector configured (start vLLM "
                          f"with --kv-transfer-config, e.g. NixlConnector){ended}")
    usage = answer.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    message = choice.get("message")
    text = choice.get("text") if message is None else \
        (message.get("content") if isinstance(message, dict) else None)
    completion = _opt_int(usage.get("completion_tokens"))
    return TokenDelta(text if isinstance(text, str) else "", 1 if completion is None
                      else completion, finish_reason="length",
                      prompt_tokens=_opt_int(usage.get("prompt_tokens")),
                      completion_tokens=completion,
                      kv_transfer=Handoff(params, x_request_id).envelope())


class OpenAIEngine:
    """The ``openai`` engine (see the module docstring)."""

    name = "openai"
    disaggregation = True  # vLLM's P/D protocol (module docstring)

    def __init__(self, base_url: str, served_model: str, *, profile: EngineProfile,
                 api_key: str | None = None, metrics_interval_s: float = 1.0,
                 connect_timeout_s: float = 5.0,
                 scheduling_policy: SchedulingPolicy = "fcfs") -> None:
        self.base_url = base_url.rstrip("/")
        self._by_priority = scheduling_policy == "priority"
        # Dropped for good once the server refuses it (a strict OpenAI-compatible server).
        self._continuous_usage = True
        self.served_model = served_model
        self.profile = profile
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._metrics_interval_s = metrics_interval_s
        # No read timeout: a long generation may pause; deadlines are the worker's job.
        self._timeout = httpx.Timeout(connect=connect_timeout_s, read=None, write=30.0,
                                      pool=connect_timeout_s)
        # One connection per stream and no cap: the worker bounds its requests in flight
        # (max_num_seqs unless told more); httpx's default of 100 made every stream beyond
        # it wait for the pool and fail. Idle connections kept for a batch's worth.
        self._limits = httpx.Limits(max_connections=None,
                                    max_keepalive_connections=profile.max_num_seqs)
        self._client: httpx.AsyncClient | None = None
        self._metrics_client: httpx.AsyncClient | None = None
        self._poller: asyncio.Task[None] | None = None
        self._load: ServerLoad | None = None
        self._metrics_missing = False  # the server answered 404 on /metrics
        self._responses: dict[str, httpx.Response] = {}
        self._prefills: dict[str, asyncio.Future[httpx.Response]] = {}  # prefills posted
        self._in_flight: dict[str, int] = {}  # request_id -> prompt + max tokens
        self._aborted: set[str] = set()
        self._rate = RateMeter()
        # Set once a prefill answer showed the server has no KV connector (module
        # docstring): the engine is dead for the worker, which exits.
        self._no_connector: str | None = None
        self._warned_header_pairing = False  # logged once (module docstring)

    async def start(self) -> None:
        self._client = httpx.AsyncClient(base_url=self.base_url, headers=self._headers,
                                         timeout=self._timeout, limits=self._limits)
        self._metrics_client = httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers, timeout=5.0,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
        try:
            await self._check_served_model()
        except EngineMisconfigured:
            await self.close()
            raise
        await self.refresh_metrics()
        self._poller = asyncio.create_task(self._poll(), name="openai-engine-metrics")

    async def _check_served_model(self) -> None:
        """Refuse a server that certainly does not serve ``served_model`` at this URL (one
        ``GET /v1/models``): a 404 to a URL ending in ``/v1`` (every request would go to
        ``/v1/v1/...``), or a model list without it (every request answered
        ``unknown_model``). Raises :class:`EngineMisconfigured`. A server that cannot be
        asked (down, still loading, no such endpoint, an answer not a model list) is let
        be: its requests fail or the scrape fails closed, as before."""
        assert self._metrics_client is not None
        try:
            response = await self._metrics_client.get("/v1/models")
        except httpx.HTTPError as exc:
            _log.warning("openai engine: cannot list the server's models: %s", exc)
            return
        if response.status_code == 404 and self.base_url.endswith("/v1"):
            raise EngineMisconfigured(
                f"{self.base_url}/v1/models is not found: the engine adds /v1 itself, "
                f"drop /v1 from --openai-url ({self.base_url.removesuffix('/v1')})")
        if response.status_code != 200:
            _log.warning("openai engine: /v1/models answered %s; model %r not checked",
                         response.status_code, self.served_model)
            return
        try:
            data = response.json()["data"]
            served = [m["id"] for m in data if isinstance(m, dict)]
        except (ValueError, KeyError, TypeError) as exc:
            _log.warning("openai engine: /v1/models is not a model list (%r); model %r "
                         "not checked", exc, self.served_model)
            return
        if self.served_model not in served:
            listed = ", ".join(repr(str(m)) for m in served[:10])
            raise EngineMisconfigured(
                f"the server at {self.base_url} serves [{listed}"
                f"{', ...' if len(served) > 10 else ''}], not {self.served_model!r}: fix "
                "--openai-model")

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        for request_id in [*self._responses, *self._prefills]:
            await self.abort(request_id)
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._metrics_client is not None:
            await self._metrics_client.aclose()
            self._metrics_client = None

    # ---- generation ------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        if self._client is None:
            raise EngineError("worker_lost", "openai engine is not started")
        if self._no_connector is not None:
            raise EngineError("worker_lost", self._no_connector)
        # A decode's hand-off is checked before anything is sent (Handoff.of raises).
        headers = {REQUEST_ID_HEADER: Handoff.of(request.kv_transfer).x_request_id} \
            if request.phase == "decode" else None
        rid = request.request_id
        self._in_flight[rid] = request.prompt_tokens + request.max_tokens
        tally = _Tally()
        try:
            if request.phase == "prefill":
                yield await self._prefill(request)
                return
            while True:
                path, body = request_body(request, self.served_model,
                                          priority=self._by_priority,
                                          continuous_usage=self._continuous_usage)
                async with self._client.stream("POST", path, json=body,
                                               headers=headers) as response:
                    self._responses[rid] = response
                    if rid in self._aborted:  # aborted while its headers were awaited
                        raise EngineAborted(f"request {rid} aborted")
                    sent_it = "continuous_usage_stats" in body["stream_options"]
                    if sent_it and await _refuses_usage_stats(response):
                        # By what this request sent, not the flag: requests in flight at
                        # the first refusal are refused too and must be asked again.
                        if self._continuous_usage:
                            self._continuous_usage = False
                            _log.warning("engine server refuses stream_options."
                                         "continuous_usage_stats; counting one token a "
                                         "chunk, corrected by the final usage")
                        if rid in self._aborted:
                            raise EngineAborted(f"request {rid} aborted")
                        continue  # the same request again, without it (nothing streamed)
                    await self._check_status(response, request.phase)
                    async for event in self._events(response):
                        if rid in self._aborted:
                            # Lines already buffered still arrive after aclose(): drop them.
                            raise EngineAborted(f"request {rid} aborted")
                        delta = tally.take(event)
                        if delta is not None:
                            self._rate.add(delta.tokens, time.monotonic())
                            yield delta
                    yield tally.last()
                    return
        except (httpx.HTTPError, EngineError) as exc:
            if rid in self._aborted:
                raise EngineAborted(f"request {rid} aborted") from None
            if isinstance(exc, EngineError):
                raise
            raise EngineError("worker_lost", f"engine server: {type(exc).__name__}: {exc}") \
                from None
        finally:
            self._responses.pop(rid, None)
            self._in_flight.pop(rid, None)
            self._aborted.discard(rid)

    async def _prefill(self, request: GenerateRequest) -> TokenDelta:
        """A prefill stage: one non-streaming request with a fresh ``X-Request-Id``
        (module docstring). Its answer's headers come only once the prompt is computed, so
        it runs as a task that :meth:`abort` cancels (closing the connection, which makes
        vLLM abort it). An answer without ``kv_transfer_params`` kills the engine."""
        assert self._client is not None
        rid = request.request_id
        path, body = request_body(request, self.served_model, priority=self._by_priority)
        x_request_id = str(uuid.uuid4())  # as vLLM's proxy makes them
        post = asyncio.ensure_future(self._client.post(
            path, json=body, headers={REQUEST_ID_HEADER: x_request_id}))
        self._prefills[rid] = post
        try:
            await asyncio.wait({post})
        finally:
            post.cancel()  # a no-op once done; cancelled ourselves: the request goes too
            self._prefills.pop(rid, None)
        if post.cancelled():
            raise EngineAborted(f"request {rid} aborted")
        response = post.result()
        await self._check_status(response, request.phase)
        try:
            answer = response.json()
        except ValueError:
            raise EngineError("worker_lost", "engine server's prefill answer is not JSON: "
                                             f"{response.text[:200]!r}") from None
        try:
            delta = prefill_delta(answer, x_request_id)
        except NoKvConnector as exc:
            self._die(exc.message)
            raise
        self._check_pairing(answer["kv_transfer_params"])
        return delta

    def _die(self, message: str) -> None:
        """Report the engine dead (``capacity().alive`` False): the server cannot run a
        prefill stage, so the worker must go (module docstring). Logged once."""
        if self._no_connector is None:
            self._no_connector = message
            _log.error("openai engine: the server at %s has no KV connector (start vLLM with "
                       "--kv-transfer-config): it answered a prefill without "
                       "kv_transfer_params; this worker stops", self.base_url)

    def _check_pairing(self, params: Mapping[str, Any]) -> None:
        """Warn once of a vLLM that pairs the stages by the ``X-Request-Id`` header only
        (its parameters name the prefill's engine but not its request)."""
        if self._warned_header_pairing or params.get("remote_engine_id") is None \
                or params.get("remote_request_id") is not None:
            return
        self._warned_header_pairing = True
        _log.warning("openai engine: the server's kv_transfer_params have remote_engine_id "
                     "but no remote_request_id (an older vLLM): its stages are paired by the "
                     "X-Request-Id header only, which llmq sends both of them")

    async def abort(self, request_id: str) -> None:
        post = self._prefills.get(request_id)
        if post is not None:
            self._aborted.add(request_id)
            post.cancel()
        response = self._responses.get(request_id)
        if response is not None:
            self._aborted.add(request_id)
            await response.aclose()  # vLLM aborts a request whose client went away
        elif request_id in self._in_flight:
            # Sent, its response headers not read yet: the stream ends as soon as they
            # come (closing it is what aborts the request in vLLM).
            self._aborted.add(request_id)

    @staticmethod
    async def _check_status(response: httpx.Response, phase: Phase) -> None:
        if response.status_code < 400:
            return
        body = (await response.aread()).decode(errors="replace")[:500]
        raise EngineError(_status_code(response.status_code, body, phase),
                          f"engine server answered {response.status_code}: {body}")

    @staticmethod
    async def _events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
        """The JSON payloads of an SSE stream, until ``[DONE]``."""
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # comments, event names, blank separators
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                return
            try:
                event = json.loads(data)
            except json.JSONDecodeError:
                raise EngineError("worker_lost", f"bad SSE payload: {data[:200]}") from None
            if isinstance(event, dict):
                if "error" in event:
                    raise EngineError("worker_lost", f"engine server error: {event['error']}")
                yield event

    # ---- capacity --------------------------------------------------------------------
    async def refresh_metrics(self) -> None:
        """Scrape /metrics once; on failure the load becomes unknown (fail closed)."""
        assert self._metrics_client is not None
        # Only a 404 now means "a server without /metrics" (accounted locally); any other
        # failure, even after an earlier 404, means the load is unknown. The view changes
        # only once the answer is in: set before the await, capacity() read in between
        # (a heartbeat) saw an unknown load, no free KV, at every scrape.
        try:
            response = await self._metrics_client.get("/metrics")
        except httpx.HTTPError as exc:
            _log.warning("openai engine: /metrics unreachable: %s", exc)
            self._load, self._metrics_missing = None, False
            return
        if response.status_code == 404:
            self._load, self._metrics_missing = None, True
            return
        if response.status_code >= 400:
            _log.warning("openai engine: /metrics answered %s", response.status_code)
            self._load, self._metrics_missing = None, False
            return
        try:
            load = parse_vllm_metrics(response.text)
        except ValueError as exc:
            _log.warning("openai engine: /metrics unparsable: %s", exc)
            self._load, self._metrics_missing = None, False
            return
        self._load, self._metrics_missing = load, False

    async def _poll(self) -> None:
        """Refresh the load until cancelled; a scrape that fails in a way refresh_metrics
        does not expect leaves the load unknown (fail closed), and the poll goes on: were the
        task to end, capacity would freeze at the last scrape."""
        while True:
            await asyncio.sleep(self._metrics_interval_s)
            try:
                await self.refresh_metrics()
            except Exception:
                _log.exception("openai engine: /metrics scrape failed")
                self._load, self._metrics_missing = None, False

    def capacity(self) -> EngineCapacity:
        """The load of the last scrape (module docstring); not alive, with no free KV, once
        the server showed it has no KV connector."""
        load, p = self._load, self.profile
        block_size = (load.block_size if load else None) or p.block_size
        blocks = (load.num_gpu_blocks if load else None) or p.num_blocks
        total = blocks * block_size
        if load is not None and load.kv_usage is not None:
            free = round(total * (1.0 - load.kv_usage))
            running, waiting = load.running, load.waiting
        elif self._metrics_missing:
            free = max(0, total - sum(self._in_flight.values()))
            n = len(self._in_flight)  # beyond max_num_seqs the server queues them
            running, waiting = min(n, p.max_num_seqs), max(0, n - p.max_num_seqs)
        else:
            free = 0  # unknown: fail closed
            running, waiting = len(self._in_flight), 0
        alive = self._no_connector is None
        free = free if alive else 0
        return EngineCapacity(
            kv_total_tokens=total,
            kv_free_tokens=free,
            kv_total_bytes=total * p.kv_bytes_per_token,
            kv_free_bytes=free * p.kv_bytes_per_token,
            block_size=block_size,
            running=running,
            waiting=waiting,
            max_num_seqs=p.max_num_seqs,
            tokens_per_s=self._rate.rate(time.monotonic()),
            alive=alive,
        )
