"""Token counts and KV-cache sizes: how much of a worker one request will hold.

Prompt tokens
    Exact where the model's tokenizer is available offline: :func:`counter_from_tokenizer_json`
    wraps a Hugging Face ``tokenizer.json`` when the optional ``tokenizers`` package is
    importable. Otherwise the estimate is ``ceil(utf8_bytes / 4)``: byte-level BPE
    vocabularies of 32k-150k entries (Llama-3, Qwen2.5, Mistral) average about 4 bytes per
    token on English prose and a little less on code; the estimate errs low on CJK text
    (~3 bytes per character, 1-2 characters per token). Errors are corrected where they
    matter: the worker reports actual usage and :func:`~services.ingest.core.rate_limit.settle`
    charges or refunds the difference.

    Chat prompts add ``MESSAGE_OVERHEAD_TOKENS`` per message (role header and end marker of
    the chat template: 5 for Llama-3 ``<|start_header_id|>role<|end_header_id|>\\n\\n …
    <|eot_id|>`` and for ChatML ``<|im_start|>role\\n … <|im_end|>\\n``) plus
    ``REPLY_PRIMING_TOKENS`` once (BOS and the assistant header that opens the reply).

KV cache (vLLM paged attention)
    ``kv_bytes_per_token = num_layers × num_kv_heads × head_dim × 2 (K and V) × dtype_bytes``
    — Llama-3(.1)-8B: 32 × 8 × 128 × 2 × 2 = 131,072 B; Qwen2.5-7B: 28 × 4 × 128 × 2 × 2 =
    57,344 B. vLLM allocates whole blocks of ``block_size`` tokens, so a request holds
    ``kv_tokens_for(prompt, max_tokens, block_size) = ceil((prompt + max_tokens) /
    block_size) × block_size`` token slots at most; that is what the scheduler reserves.

Model shapes live in :mod:`services.ingest.core.models`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, Protocol

from services.ingest.core.models import ModelRegistry, ModelShape

#: Estimate divisor: UTF-8 bytes per token for byte-level BPE on English text.
BYTES_PER_TOKEN: Final = 4
#: Chat-template tokens around each message (header with role, end marker).
MESSAGE_OVERHEAD_TOKENS: Final = 5
#: Tokens that open the reply once per chat prompt (BOS + assistant header).
REPLY_PRIMING_TOKENS: Final = 5


class TokenCounter(Protocol):
    """Counts the tokens of one text. Implementations are pure and thread-safe."""

    def count(self, text: str) -> int:
        """Number of tokens ``text`` encodes to, without special tokens."""
        ...


class ByteEstimateCounter:
    """``ceil(len(text.encode('utf-8')) / BYTES_PER_TOKEN)``: the offline fallback."""

    __slots__ = ()

    def count(self, text: str) -> int:
        return -(-len(text.encode("utf-8")) // BYTES_PER_TOKEN)


class HfTokenizerCounter:
    """Exact count with a Hugging Face ``tokenizers.Tokenizer`` (optional dependency)."""

    __slots__ = ("_tokenizer",)

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)


ESTIMATE: Final = ByteEstimateCounter()


class _Message(Protocol):
    @property
    def content(self) -> str: ...


class PromptInput(Protocol):
    """What a request's prompt is read from (``schemas.requests.InferenceRequest``)."""

    @property
    def prompt(self) -> str | None: ...

    @property
    def messages(self) -> Sequence[_Message] | None: ...


def counter_from_tokenizer_json(tokenizer_json: str | None) -> TokenCounter:
    """The exact counter for a ``tokenizer.json`` text, else the byte estimate.

    The adapter reads the file named by ``models.<name>.tokenizer`` at startup and passes
    its text here (the core does no I/O). Falls back to :data:`ESTIMATE` when no text is
    given or ``tokenizers`` is not installed; a text that ``tokenizers`` cannot parse raises
    its own exception, because a configured tokenizer that does not load is a config bug.
    """
    if tokenizer_json is None:
        return ESTIMATE
    try:
        module = importlib.import_module("tokenizers")
    except ImportError:
        return ESTIMATE
    return HfTokenizerCounter(module.Tokenizer.from_str(tokenizer_json))


def prompt_tokens(text: str, counter: TokenCounter = ESTIMATE) -> int:
    """Tokens of a plain completion prompt."""
    return counter.count(text)


def chat_prompt_tokens(contents: Iterable[str], counter: TokenCounter = ESTIMATE) -> int:
    """Tokens of a chat prompt given the text of each message, template overhead included.

    ``Σ (count(content) + MESSAGE_OVERHEAD_TOKENS) + REPLY_PRIMING_TOKENS``. The adapter
    flattens multi-part contents to their text parts before calling.
    """
    total = REPLY_PRIMING_TOKENS
    for content in contents:
        total += counter.count(content) + MESSAGE_OVERHEAD_TOKENS
    return total


def counter_for(
    model: str, registry: ModelRegistry, counters: Mapping[str, TokenCounter]
) -> TokenCounter:
    """The counter for ``model`` (a name or alias): its tokenizer's when one was loaded
    (``counters`` is keyed by canonical name), else :data:`ESTIMATE`."""
    shape = registry.get(model)
    return counters.get(shape.name if shape is not None else model, ESTIMATE)


def request_prompt_tokens(request: PromptInput, counter: TokenCounter = ESTIMATE) -> int:
    """Prompt tokens of a request: its completion prompt, or its chat messages with the
    template's overhead."""
    if request.prompt is not None:
        return prompt_tokens(request.prompt, counter)
    return chat_prompt_tokens((m.content for m in request.messages or ()), counter)


def blocks_for(tokens: int, block_size: int) -> int:
    """``ceil(tokens / block_size)``: KV blocks needed for ``tokens`` token slots."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    return -(-tokens // block_size)


def kv_tokens_for(prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """Token slots a request may hold: ``blocks_for(prompt + max_tokens) × block_size``."""
    return blocks_for(prompt_tokens + max_tokens, block_size) * block_size


def kv_bytes_for(prompt_tokens: int, max_tokens: int, shape: ModelShape) -> int:
    """Bytes of KV cache a request may hold on a worker serving ``shape``."""
    slots = kv_tokens_for(prompt_tokens, max_tokens, shape.block_size)
    return slots * shape.kv_bytes_per_token
