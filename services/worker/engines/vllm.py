"""The ``vllm`` engine: vLLM's ``AsyncLLM`` (V1 engine) in the worker's own process.

Optional: needs the ``vllm`` extra (``pip install 'llmq[vllm]'``) and, in practice, a GPU.
vLLM is imported in :meth:`VllmEngine.start`, never when this module is imported, so the
worker package stays importable without it.

API used (vLLM ≥ 0.9.2, V1 — the first whose V1 engine takes ``scheduling_policy=
"priority"``): ``AsyncLLM.from_engine_args(AsyncEngineArgs(model=..., ...))``;
``async for out in llm.generate(prompt, SamplingParams(...), request_id)`` yields
``RequestOutput`` values whose ``outputs[0].text`` / ``.token_ids`` are cumulative (the
default ``RequestOutputKind.CUMULATIVE``), so this adapter emits the difference to the
previous output as a delta; ``await llm.abort(request_id)``; ``llm.shutdown()``. The
engine runs with ``scheduling_policy="priority"`` unless told otherwise, and each request
goes in with ``priority=`` its ``GenerateRequest.priority`` (class, then lane: 0 high
short … 5 low long), so a high-class request also overtakes the engine's own waiting queue. Chat
requests are rendered with the tokenizer's chat template (``llm.get_tokenizer()``: a
coroutine up to vLLM 0.10, a plain method since; both are taken) and go in as token ids
(``{"prompt_token_ids": ...}``, a ``TokensPrompt``): the rendered text already holds the
template's special tokens, and a text prompt would be tokenized again with
``add_special_tokens=True`` (a second BOS on Llama 3). vLLM's own chat endpoint does the same.
Plain prompts go in as text.

Capacity: pool size from ``vllm_config.cache_config`` (``num_gpu_blocks`` × ``block_size``),
batch limit from ``scheduler_config.max_num_seqs``; AsyncLLM exposes no live KV figure to
an in-process caller, so free KV is estimated from the requests in flight (computed tokens
so far, rounded up to blocks), and running/waiting are split at ``max_num_seqs``. VRAM and
utilisation come from NVML in the worker app. Once ``AsyncLLM.errored`` (its engine core
died), capacity reads as dead with no free KV (fail closed).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from schemas.common import ErrorCode
from services.worker.core.rate import RateMeter
from services.worker.engines.base import (
    EngineAborted,
    EngineCapacity,
    EngineError,
    FinishReason,
    GenerateRequest,
    SchedulingPolicy,
    TokenDelta,
)
from services.worker.engines.sim.model import EngineProfile

INSTALL_HINT = "the vllm engine needs vLLM: pip install 'llmq[vllm]' (GPU machines)"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class VllmEngine:
    """The ``vllm`` engine (see the module docstring)."""

    name = "vllm"
    #: Not built: prefill/decode apart would pass ``kv_transfer_params`` in
    #: ``SamplingParams.extra_args`` (as vLLM's OpenAI server does) to a KV connector
    #: configured in the engine args (``kv_transfer_config``), and read the prefill's from
    #: ``RequestOutput.kv_transfer_params``; none of it can be tested without vLLM.
    #: Roles prefill and decode are refused at startup for this engine; use ``openai``.
    disaggregation = False

    def __init__(self, model: str, *, profile: EngineProfile,
                 engine_args: Mapping[str, Any] | None = None,
                 scheduling_policy: SchedulingPolicy = "priority") -> None:
        self.model = model
        self.profile = profile
        # An explicit scheduling_policy in the engine args wins over the worker setting.
        self._engine_args = {"scheduling_policy": scheduling_policy, **(engine_args or {})}
        self._by_priority = self._engine_args["scheduling_policy"] == "priority"
        self._llm: Any = None
        self._sampling_cls: Any = None
        self._tokenizer: Any = None
        self._tokens: dict[str, int] = {}  # request_id -> prompt + generated tokens so far
        self._aborted: set[str] = set()
        self._rate = RateMeter()

    async def start(self) -> None:
        try:
            from vllm import SamplingParams
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise RuntimeError(f"{INSTALL_HINT} ({exc})") from exc
        self._sampling_cls = SamplingParams
        args = AsyncEngineArgs(model=self.model, **self._engine_args)
        self._llm = AsyncLLM.from_engine_args(args)

    async def close(self) -> None:
        if self._llm is not None:
            for request_id in list(self._tokens):
                await self.abort(request_id)
            self._llm.shutdown()
            self._llm = None

    def _sampling(self, req: GenerateRequest) -> Any:
        options: dict[str, Any] = {
            "max_tokens": req.max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty,
            "stop": list(req.stop) or None,
            "seed": req.seed,
        }
        if req.top_k is not None:
            options["top_k"] = req.top_k
        return self._sampling_cls(**options)

    async def _prompt(self, req: GenerateRequest) -> str | dict[str, list[int]]:
        """A plain prompt as text; chat turns rendered and tokenized (module docstring)."""
        if req.messages is None:
            return req.prompt or ""
        if self._tokenizer is None:
            tokenizer = self._llm.get_tokenizer()  # vLLM <= 0.10: async def; later: def
            self._tokenizer = await tokenizer if inspect.isawaitable(tokenizer) else tokenizer
        turns = [{"role": m.role, "content": m.content} for m in req.messages]
        try:
            rendered: str = self._tokenizer.apply_chat_template(
                turns, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # jinja2's TemplateError: e.g. roles that do not alternate
            raise EngineError("invalid", f"the model's chat template refused the messages: "
                                         f"{exc}") from exc
        # The template wrote the special tokens itself: add none while tokenizing.
        ids: list[int] = self._tokenizer.encode(rendered, add_special_tokens=False)
        return {"prompt_token_ids": ids}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        if self._llm is None:
            raise EngineError("worker_lost", "vllm engine is not started")
        rid = request.request_id
        prompt = await self._prompt(request)
        text_len = n_tokens = 0
        self._tokens[rid] = request.prompt_tokens
        finished = False
        try:
            # vLLM refuses a priority other than 0 unless it schedules by priority.
            priority = request.priority if self._by_priority else 0
            stream = self._llm.generate(prompt, self._sampling(request), rid, priority=priority)
            async for out in _refusals_as_errors(stream):
                if rid in self._aborted:
                    raise EngineAborted(f"request {rid} aborted")
                completion = out.outputs[0]
                text, count = completion.text, len(completion.token_ids)
                prompt_tokens = len(out.prompt_token_ids or ())
                self._tokens[rid] = prompt_tokens + count
                self._rate.add(count - n_tokens, time.monotonic())
                reason = _finish_reason(completion.finish_reason) if out.finished else None
                delta = TokenDelta(
                    text[text_len:], count - n_tokens, finish_reason=reason,
                    prompt_tokens=prompt_tokens if reason else None,
                    completion_tokens=count if reason else None,
                )
                text_len, n_tokens = len(text), count
                if delta.tokens or delta.text or reason:
                    yield delta
                if out.finished:
                    finished = True
                    if reason is None:
                        raise EngineAborted(f"request {rid} was aborted by vLLM")
                    return
            if rid in self._aborted:
                raise EngineAborted(f"request {rid} aborted")
            raise EngineError("worker_lost", "vLLM stream ended without finishing")
        finally:
            self._tokens.pop(rid, None)
            self._aborted.discard(rid)
            if not finished and self._llm is not None:
                with contextlib.suppress(Exception):  # best effort: free the KV
                    await self._llm.abort(rid)

    async def abort(self, request_id: str) -> None:
        if self._llm is not None and request_id in self._tokens:
            self._aborted.add(request_id)
            await self._llm.abort(request_id)

    def capacity(self) -> EngineCapacity:
        p = self.profile
        block_size, blocks, max_seqs = p.block_size, p.num_blocks, p.max_num_seqs
        if self._llm is not None:
            cache = self._llm.vllm_config.cache_config
            block_size = int(cache.block_size or block_size)
            blocks = int(cache.num_gpu_blocks or blocks)
            max_seqs = int(self._llm.vllm_config.scheduler_config.max_num_seqs or max_seqs)
        total = blocks * block_size
        used = sum(_ceil_div(n, block_size) for n in self._tokens.values()) * block_size
        alive = self._llm is None or not self._llm.errored  # None: not started, or closed
        free = max(0, total - used) if alive else 0
        per_token = p.kv_bytes_per_token
        n = len(self._tokens)
        return EngineCapacity(
            kv_total_tokens=total, kv_free_tokens=free,
            kv_total_bytes=total * per_token, kv_free_bytes=free * per_token,
            block_size=block_size, running=min(n, max_seqs), waiting=max(0, n - max_seqs),
            max_num_seqs=max_seqs, tokens_per_s=self._rate.rate(time.monotonic()),
            alive=alive,
        )


def _finish_reason(reason: object) -> FinishReason | None:
    """vLLM's finish_reason → ours; None for an abort ("abort") or unknown state.

    ``"repetition"`` (vLLM stopped a repeating output) is a stop; ``"error"`` (a
    request-level failure inside vLLM, e.g. a KV load) raises ``EngineError``.
    """
    if reason == "error":
        raise EngineError("worker_lost", "vLLM ended the request with an error")
    if reason == "length":
        return "length"
    if reason in ("stop", "repetition"):
        return "stop"
    return None


def says_prompt_too_long(message: str) -> bool:
    """Whether vLLM's refusal ``message`` says the prompt is over the model's length (the
    in-process ``ValueError`` and the OpenAI server's 400 alike)."""
    return "maximum model length" in message or "maximum context length" in message


async def _refusals_as_errors(stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """vLLM's outputs, with its refusal of a request's input as an :class:`EngineError`.

    vLLM validates a request when it is submitted, before any output, and refuses it with
    ``ValueError`` (a prompt longer than ``max_model_len``, a bad sampling parameter).
    That is the request's fault, not the worker's: ``too_large`` for the length, else
    ``invalid``. A ``ValueError`` after the first output is left alone (a bug, not a
    refusal: the runner answers it ``worker_lost``).
    """
    started = False
    try:
        async for out in stream:
            started = True
            yield out
    except ValueError as exc:
        if started:
            raise
        text = str(exc)
        code: ErrorCode = "too_large" if says_prompt_too_long(text) else "invalid"
        raise EngineError(code, f"vLLM refused the request: {text}") from exc
