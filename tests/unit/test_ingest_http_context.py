"""A call that sets no ``max_tokens`` asks for at most the rest of its model's context.

The endpoint's default (16 for completions, 512 for chat) is lowered to ``max_model_len −
prompt tokens`` when that is less, as vLLM's server does for an unset ``max_tokens``;
before, a long prompt without ``max_tokens`` was refused 413 for a limit the client never
set. A ``max_tokens`` the client gave is never changed (too large stays too large).
Driven through the ASGI app with the real gateway (its producer a stand-in, as in
test_ingest_http_streams.py); the registry is the built-in one (llama-3-8b: 8,192 tokens
of context), prompts are counted by the byte estimate (4 bytes a token).
"""

from __future__ import annotations

from typing import Any

import pytest

from services.ingest.core import ModelRegistry, fitted_max_tokens
from tests.builders_schemas import make_done
from tests.unit.test_ingest_http_streams import Api, Reply

CONTEXT = 8_192  # llama-3-8b's max_model_len in the built-in registry


def done(rid: str) -> Reply:
    return make_done(request_id=rid, attempt=1)


async def submitted_max_tokens(body: dict[str, Any], path: str) -> int:
    api = Api([(0.01, done)])
    out = await api.post(body, path=path)
    assert out.status == 200, out.body
    [request] = api.producer.requests
    return request.max_tokens


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "llama-3-8b", "messages": [{"role": "user", "content": content}], **extra}


async def test_a_chat_without_max_tokens_gets_the_rest_of_the_context() -> None:
    # 32,000 bytes = 8,000 tokens + 5 for the message + 5 to prime the reply: 182 left.
    got = await submitted_max_tokens(chat("abcd" * 8_000), "/v1/chat/completions")
    assert got == CONTEXT - 8_010


async def test_a_chat_whose_prompt_leaves_room_keeps_the_default() -> None:
    got = await submitted_max_tokens(chat("abcd" * 7_000), "/v1/chat/completions")
    assert got == 512


async def test_a_completion_without_max_tokens_is_fitted_too() -> None:
    # 8,190 prompt tokens: 2 left, under the endpoint's default of 16.
    body = {"model": "llama-3-8b", "prompt": "abcd" * 8_190}
    assert await submitted_max_tokens(body, "/v1/completions") == 2


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_a_max_tokens_the_client_gave_is_kept(field: str) -> None:
    got = await submitted_max_tokens(chat("abcd" * 8_000, **{field: 512}),
                                     "/v1/chat/completions")
    assert got == 512  # admission refuses it too_large, as the client asked for it


async def test_a_model_outside_the_registry_keeps_the_default() -> None:
    # "m" is served by a live worker (the harness's heartbeat), its context unknown here.
    got = await submitted_max_tokens({"model": "m", "messages": [
        {"role": "user", "content": "abcd" * 40_000}]}, "/v1/chat/completions")
    assert got == 512


@pytest.mark.parametrize(("default", "prompt", "expected"), [
    (512, 100, 512),            # room to spare: the default
    (512, CONTEXT - 512, 512),  # exactly the default left
    (512, CONTEXT - 511, 511),  # one short: the rest of the context
    (512, CONTEXT - 1, 1),      # one token left
    (512, CONTEXT, 512),        # none left: unchanged, admission refuses it 413
    (512, CONTEXT + 10, 512),
])
def test_fitted_max_tokens(default: int, prompt: int, expected: int) -> None:
    shape = ModelRegistry.from_mapping().get("llama-3-8b")
    assert fitted_max_tokens(default, prompt, shape) == expected
    assert fitted_max_tokens(default, prompt, None) == default
