"""Token estimates, model shapes and KV arithmetic of the ingest core."""

from __future__ import annotations

import sys

import pytest

from services.ingest.core import (
    ESTIMATE,
    KNOWN_MODELS,
    ByteEstimateCounter,
    ConfigError,
    ModelRegistry,
    ModelShape,
    blocks_for,
    chat_prompt_tokens,
    counter_from_tokenizer_json,
    kv_bytes_for,
    kv_tokens_for,
    prompt_tokens,
)


class WordCounter:
    """A fake TokenCounter: one token per whitespace-separated word."""

    def count(self, text: str) -> int:
        return len(text.split())


@pytest.mark.parametrize(
    ("name", "kv_bytes"),
    [
        ("llama-3.1-8b", 131_072),
        ("meta-llama/Llama-3.1-8B-Instruct", 131_072),
        ("llama-3-8b", 131_072),
        ("qwen2.5-7b", 57_344),
        ("Qwen/Qwen2.5-7B-Instruct", 57_344),
        ("mistral-7b", 131_072),
        ("smollm2-135m", 23_040),
    ],
)
def test_kv_bytes_per_token_of_known_models(name: str, kv_bytes: int) -> None:
    shape = ModelRegistry.from_mapping().get(name)
    assert shape is not None
    assert shape.kv_bytes_per_token == kv_bytes


def test_known_models_have_the_default_block_size_and_bf16() -> None:
    assert {(m.block_size, m.dtype_bytes) for m in KNOWN_MODELS} == {(16, 2)}


@pytest.mark.parametrize(
    ("tokens", "block_size", "blocks"),
    [(0, 16, 0), (1, 16, 1), (15, 16, 1), (16, 16, 1), (17, 16, 2), (32, 16, 2),
     (33, 16, 3), (7, 1, 7), (100, 32, 4)],
)
def test_blocks_for_rounds_up(tokens: int, block_size: int, blocks: int) -> None:
    assert blocks_for(tokens, block_size) == blocks


@pytest.mark.parametrize(("tokens", "block_size"), [(1, 0), (1, -16), (-1, 16)])
def test_blocks_for_refuses_nonsense(tokens: int, block_size: int) -> None:
    with pytest.raises(ValueError, match="must be"):
        blocks_for(tokens, block_size)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "block_size", "slots"),
    [(100, 100, 16, 208), (8, 8, 16, 16), (1000, 1, 16, 1008), (1, 1, 16, 16), (10, 10, 32, 32)],
)
def test_kv_tokens_for_is_whole_blocks_of_prompt_plus_max_tokens(
    prompt: int, max_tokens: int, block_size: int, slots: int
) -> None:
    assert kv_tokens_for(prompt, max_tokens, block_size) == slots


def test_kv_bytes_for_llama_3_8b_request() -> None:
    shape = ModelRegistry.from_mapping().get("llama-3-8b")
    assert shape is not None
    # 1000 + 24 = 1024 tokens = 64 blocks exactly; 128 KiB each = 128 MiB.
    assert kv_bytes_for(1000, 24, shape) == 1024 * 131_072 == 128 * 2**20


@pytest.mark.parametrize(
    ("text", "tokens"),
    [("", 0), ("abc", 1), ("abcd", 1), ("abcde", 2), ("é", 1), ("日本語", 3),
     ("The quick brown fox jumps over the lazy dog", 11)],
)
def test_byte_estimate_is_utf8_bytes_over_four_rounded_up(text: str, tokens: int) -> None:
    assert ByteEstimateCounter().count(text) == tokens
    assert prompt_tokens(text) == tokens


@pytest.mark.parametrize(
    ("contents", "tokens"),
    [([], 5), (["abcd"], 1 + 5 + 5), (["abcd", "abcdefgh"], (1 + 5) + (2 + 5) + 5)],
)
def test_chat_prompt_adds_template_overhead(contents: list[str], tokens: int) -> None:
    assert chat_prompt_tokens(contents) == tokens


def test_chat_prompt_uses_the_given_counter() -> None:
    assert chat_prompt_tokens(["one two three", "four"], WordCounter()) == 3 + 1 + 2 * 5 + 5


def test_no_tokenizer_configured_falls_back_to_the_estimate() -> None:
    assert counter_from_tokenizer_json(None) is ESTIMATE


def test_tokenizers_not_installed_falls_back_to_the_estimate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    assert counter_from_tokenizer_json('{"model": {}}') is ESTIMATE


@pytest.mark.parametrize(
    "field", ["num_layers", "num_kv_heads", "head_dim", "dtype_bytes", "block_size",
              "max_model_len"],
)
@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "8"])
def test_model_shape_fields_must_be_positive_ints(field: str, bad: object) -> None:
    table: dict[str, object] = {
        "num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "max_model_len": 1024, field: bad,
    }
    with pytest.raises(ConfigError) as caught:
        ModelShape.from_mapping("foo", table)
    assert caught.value.setting == f"models.foo.{field}"
    assert f"models.foo.{field}" in str(caught.value)


def test_model_shape_direct_construction_is_validated_too() -> None:
    with pytest.raises(ConfigError, match=r"models\.foo\.num_kv_heads"):
        ModelShape("foo", num_layers=2, num_kv_heads=0, head_dim=64, max_model_len=8)


@pytest.mark.parametrize(
    ("table", "setting"),
    [
        ({"num_kv_heads": 2, "head_dim": 64, "max_model_len": 8}, "models.foo.num_layers"),
        ({"num_layers": 2, "num_kv_heads": 2, "head_dim": 64}, "models.foo.max_model_len"),
        ({"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "max_model_len": 8,
          "colour": "red"}, "models.foo.colour"),
        ({"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "max_model_len": 8,
          "aliases": "foo-1"}, "models.foo.aliases"),
        ("not a table", "models.foo"),
    ],
)
def test_model_shape_from_mapping_names_the_bad_setting(table: object, setting: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ModelShape.from_mapping("foo", table)
    assert caught.value.setting == setting


def test_registry_adds_user_models_and_overrides_known_ones() -> None:
    registry = ModelRegistry.from_mapping({
        "foo": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 64, "max_model_len": 512,
                "aliases": ["org/Foo"], "version": "v1"},
        "llama-3-8b": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128,
                       "max_model_len": 4096},
    })
    foo = registry.get("org/Foo")
    assert foo is not None and foo.name == "foo" and foo.version == "v1"
    assert foo.kv_bytes_per_token == 2 * 1 * 64 * 2 * 2
    llama = registry.get("llama-3-8b")
    assert llama is not None and llama.max_model_len == 4096
    assert "meta-llama/Meta-Llama-3-8B" not in registry  # the override replaced the aliases
    assert "qwen2.5-7b" in registry
    assert len(registry) == len(KNOWN_MODELS) + 1


def test_registry_without_known_models() -> None:
    registry = ModelRegistry.from_mapping(
        {"foo": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 64, "max_model_len": 512}},
        include_known=False,
    )
    assert [shape.name for shape in registry] == ["foo"]
    assert registry.get("llama-3.1-8b") is None


def test_registry_refuses_an_alias_claimed_by_two_models() -> None:
    with pytest.raises(ConfigError) as caught:
        ModelRegistry.from_mapping({
            "foo": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 64, "max_model_len": 512,
                    "aliases": ["qwen2.5-7b"]},
        })
    assert caught.value.setting in {"models.foo.aliases", "models.qwen2.5-7b.aliases"}
