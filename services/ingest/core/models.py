"""Model shapes: what one token of a model costs in KV cache, and how long a sequence may be.

``KNOWN_MODELS`` holds the published shapes of the models llmq is tested with (values from
each model's ``config.json``: ``num_hidden_layers``, ``num_key_value_heads``,
``hidden_size / num_attention_heads``, ``max_position_embeddings``; weights in bf16, so
2 bytes per KV element). :class:`ModelRegistry` resolves a request's model name or alias to
its shape; operators add or override entries under ``models.<name>`` in config.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Final

from services.ingest.core import _settings as s
from services.ingest.core.errors import ConfigError

DEFAULT_BLOCK_SIZE: Final = 16
_INT_FIELDS: Final = (
    "num_layers", "num_kv_heads", "head_dim", "dtype_bytes", "block_size", "max_model_len",
)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Attention geometry of one model, as vLLM sizes its paged KV cache.

    ``kv_bytes_per_token = num_layers × num_kv_heads × head_dim × 2 × dtype_bytes`` (the 2
    is K and V). Every integer must be > 0, else :class:`ConfigError` naming
    ``models.<name>.<field>``. ``tokenizer`` is an optional path to a ``tokenizer.json``
    that the adapter loads for exact token counts.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    dtype_bytes: int = 2
    block_size: int = DEFAULT_BLOCK_SIZE
    version: str | None = None
    aliases: tuple[str, ...] = ()
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        s.string(self.name, "models.<name>")
        for name in _INT_FIELDS:
            s.positive_int(getattr(self, name), f"models.{self.name}.{name}")
        if isinstance(self.aliases, str):
            raise ConfigError(f"models.{self.name}.aliases", "must be a list of names")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token occupies on every layer."""
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * self.dtype_bytes

    @property
    def names(self) -> tuple[str, ...]:
        """The canonical name followed by every alias."""
        return (self.name, *self.aliases)

    @classmethod
    def from_mapping(
        cls, name: str, mapping: object, *, prefix: str = "models"
    ) -> ModelShape:
        """Validate one ``models.<name>`` table (unknown keys are refused)."""
        where = f"{prefix}.{name}"
        table = s.section(mapping, where)
        s.known_keys(table, [f.name for f in fields(cls) if f.name != "name"], where)
        ints = {
            key: s.positive_int(table[key], f"{where}.{key}")
            for key in _INT_FIELDS
            if key in table
        }
        for key in ("num_layers", "num_kv_heads", "head_dim", "max_model_len"):
            s.required(table, key, where)
        return cls(
            name=name,
            num_layers=ints["num_layers"],
            num_kv_heads=ints["num_kv_heads"],
            head_dim=ints["head_dim"],
            max_model_len=ints["max_model_len"],
            dtype_bytes=ints.get("dtype_bytes", 2),
            block_size=ints.get("block_size", DEFAULT_BLOCK_SIZE),
            version=_optional_string(table, "version", where),
            aliases=s.strings(table.get("aliases", ()), f"{where}.aliases"),
            tokenizer=_optional_string(table, "tokenizer", where),
        )


def _optional_string(table: Mapping[str, object], key: str, where: str) -> str | None:
    value = table.get(key)
    return None if value is None else s.string(value, f"{where}.{key}")


KNOWN_MODELS: Final[tuple[ModelShape, ...]] = (
    ModelShape(
        "llama-3.1-8b", num_layers=32, num_kv_heads=8, head_dim=128, max_model_len=131_072,
        aliases=(
            "meta-llama/Llama-3.1-8B-Instruct",
            "meta-llama/Llama-3.1-8B",
            "meta-llama/Meta-Llama-3.1-8B-Instruct",
        ),
    ),
    ModelShape(
        "llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128, max_model_len=8_192,
        aliases=("meta-llama/Meta-Llama-3-8B-Instruct", "meta-llama/Meta-Llama-3-8B"),
    ),
    ModelShape(
        "qwen2.5-7b", num_layers=28, num_kv_heads=4, head_dim=128, max_model_len=32_768,
        aliases=("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B"),
    ),
    ModelShape(
        "mistral-7b", num_layers=32, num_kv_heads=8, head_dim=128, max_model_len=32_768,
        version="v0.3",
        aliases=("mistralai/Mistral-7B-Instruct-v0.3", "mistralai/Mistral-7B-v0.3"),
    ),
    # Tiny model for tests and CPU runs: 23,040 B of KV per token.
    ModelShape(
        "smollm2-135m", num_layers=30, num_kv_heads=3, head_dim=64, max_model_len=8_192,
        aliases=("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M"),
    ),
)


class ModelRegistry:
    """Read-only lookup from a model name or alias to its :class:`ModelShape`.

    Built once at startup; a later shape with the same canonical name replaces an earlier
    one (config overrides the built-in table). A name or alias claimed by two different
    models is a :class:`ConfigError` (``models.<name>.aliases``): resolving it would be a
    guess.
    """

    __slots__ = ("_by_name", "_shapes")

    def __init__(self, shapes: Iterable[ModelShape] = ()) -> None:
        by_canonical: dict[str, ModelShape] = {}
        for shape in shapes:
            by_canonical[shape.name] = shape
        index: dict[str, ModelShape] = {}
        for shape in by_canonical.values():
            for name in shape.names:
                other = index.get(name)
                if other is not None and other.name != shape.name:
                    raise ConfigError(
                        f"models.{shape.name}.aliases", f"{name!r} already names {other.name!r}"
                    )
                index[name] = shape
        self._shapes = MappingProxyType(by_canonical)
        self._by_name = MappingProxyType(index)

    @classmethod
    def from_mapping(
        cls, mapping: Mapping[str, object] | None = None, *, include_known: bool = True
    ) -> ModelRegistry:
        """The built-in table (unless ``include_known`` is false) plus ``models.*`` entries."""
        table = s.section(mapping or {}, "models")
        extra = [ModelShape.from_mapping(name, entry) for name, entry in table.items()]
        return cls([*(KNOWN_MODELS if include_known else ()), *extra])

    def get(self, name: str) -> ModelShape | None:
        """The shape for a canonical name or alias; None when unknown."""
        return self._by_name.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[ModelShape]:
        return iter(self._shapes.values())

    def __len__(self) -> int:
        return len(self._shapes)
