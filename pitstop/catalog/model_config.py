"""A model's `config.json`, read in one place: the typed `ModelConfig` every package asks.

The shape the cost model prices, the vocabulary the token store checks, the positions a
row may span, the model type the version traps and the loader look at, the dtype an export
keeps: all come from here, so a field is parsed once, with one set of names and defaults,
and a broken file gives one clear error. Adding a field the code needs touches this file
(the field and its line in `from_mapping`) and the caller that uses it.

Names. Hugging Face configs spell a few sizes two ways (GPT-2 style `n_embd`, `n_layer`,
`n_head`, `n_inner`, `n_positions`, `n_ctx`); each field takes the first name present.
A multimodal config (Llava, Gemma 3, Mllama) keeps its language model under `text_config`:
the language-model fields are read there first, then at the top level; `model_type`,
`architectures` and `auto_map` are the top level's (they name the whole model).

Values. A size that is not a whole number above 0 (absent, null, a string, 0) reads as
None, as if absent: the callers each have their defaults or their error for a missing
size, and a config that transformers itself would reject is transformers' to report.
`raw` keeps the whole mapping (read-only) for the rare field nothing else reads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pitstop.errors import DataError

CONFIG_NAME = "config.json"

# Architectures whose positions are a learned table: a row longer than the table
# indexes past it (an IndexError on CPU, a device-side assert on CUDA).
LEARNED_POSITIONS = frozenset({"gpt2", "gpt_neo", "gpt_bigcode", "opt", "biogpt", "xglm"})

# Each size field and the config names that spell it, first found wins.
_SIZE_NAMES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "n_embd"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "num_key_value_heads": ("num_key_value_heads",),
    "intermediate_size": ("intermediate_size", "n_inner"),
    "vocab_size": ("vocab_size",),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "n_ctx"),
    "head_dim": ("head_dim",),
    "sliding_window": ("sliding_window",),
}


class ModelConfigError(DataError):
    """config.json cannot be read as a model's configuration (exit code 1)."""


class ModelConfigMissing(ModelConfigError):
    """The directory has no config.json (a tokenizer-only folder, a wrong path)."""


@dataclass(frozen=True)
class ModelConfig:
    """The facts of a Hugging Face model's config.json that pitstop reads.

    Sizes are None where the config does not give them as a whole number above 0.
    """

    source: str  # where it was read, for messages
    model_type: str | None = None
    architectures: tuple[str, ...] = ()
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    max_position_embeddings: int | None = None
    head_dim: int | None = None
    sliding_window: int | None = None  # attention window of (some) layers, None: full
    # Unset counts as untied: the reading the cost model has always priced (transformers'
    # own default differs per architecture; the configs pitstop meets write it).
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    dtype: str | None = None  # `dtype`, else the older `torch_dtype`
    has_auto_map: bool = False  # names Python modules of its own (needs trust_remote_code)
    has_text_config: bool = False  # multimodal: the language model's sizes were nested
    raw: Mapping[str, Any] = field(
        default_factory=lambda: MappingProxyType({}), repr=False, compare=False
    )

    @classmethod
    def path_in(cls, model_dir: str | Path) -> Path:
        """Where a model directory keeps its config."""
        return Path(model_dir) / CONFIG_NAME

    @classmethod
    def read(cls, model_dir: str | Path) -> ModelConfig:
        """MODEL_DIR/config.json, parsed. Raises `ModelConfigMissing` when there is none and
        `ModelConfigError` when it cannot be read, is not JSON, or is not a JSON object."""
        path = cls.path_in(model_dir)
        if not path.is_file():
            raise ModelConfigMissing(
                f"{model_dir} has no {CONFIG_NAME}, so it is not a Hugging Face model "
                f"directory; give the folder that holds {CONFIG_NAME} and the weights"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ModelConfigError(
                f"{path} is not UTF-8 text ({e}); re-download the model or save it again "
                "with save_pretrained"
            ) from None
        except OSError as e:
            raise ModelConfigError(
                f"{path} cannot be read ({e.strerror or e}); check its permissions"
            ) from None
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ModelConfigError(
                f"{path} is not valid JSON ({e}); re-download the model or save it again "
                "with save_pretrained"
            ) from None
        if not isinstance(data, dict):
            raise ModelConfigError(
                f"{path} holds a JSON {type(data).__name__}, not an object of settings "
                '({"model_type": ..., "hidden_size": ...}); re-download the model or save '
                "it again with save_pretrained"
            )
        return cls.from_mapping(data, source=str(path))

    @classmethod
    def read_optional(cls, model_dir: str | Path | None) -> ModelConfig | None:
        """`read`, or None when there is no directory, no config.json, or one that cannot
        be read: for the callers that fall back to defaults (the model's own loading
        reports a broken config)."""
        if not model_dir:
            return None
        try:
            return cls.read(model_dir)
        except ModelConfigError:
            return None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = CONFIG_NAME) -> ModelConfig:
        """A config already parsed (a dict as config.json holds it)."""
        nested = data.get("text_config")
        text: Mapping[str, Any] = nested if isinstance(nested, Mapping) else {}
        sizes = {name: _size(text, data, names) for name, names in _SIZE_NAMES.items()}
        archs = data.get("architectures")
        dtype = data.get("dtype") or data.get("torch_dtype")
        return cls(
            source=source,
            model_type=_str(data.get("model_type")),
            architectures=tuple(a for a in archs if isinstance(a, str))
            if isinstance(archs, list)
            else (),
            **sizes,
            # The top level's tie flag wins: a multimodal model ties (or not) as a whole.
            tie_word_embeddings=bool(
                data.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            ),
            attention_bias=bool(_first(text, data, "attention_bias")),
            mlp_bias=bool(_first(text, data, "mlp_bias")),
            dtype=_str(dtype) or _str(text.get("dtype") or text.get("torch_dtype")),
            has_auto_map=bool(data.get("auto_map")),
            has_text_config=bool(text),
            raw=MappingProxyType(dict(data)),
        )

    @property
    def kv_heads(self) -> int | None:
        """Key/value heads: `num_key_value_heads`, else one per attention head (no GQA)."""
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def attention_head_dim(self) -> int | None:
        """Width of one head: `head_dim`, else hidden / heads (what transformers assumes)."""
        if self.head_dim:
            return self.head_dim
        if self.hidden_size and self.num_attention_heads:
            return self.hidden_size // self.num_attention_heads
        return None

    def size_problems(self) -> list[str]:
        """ "hidden_size is -64" for each size the config gives as a number that is not a
        whole one above 0: a model built from it fails deep inside torch. Other kinds of
        value are left to the architecture (Gemma 3n lists a size per layer), and so is a
        sliding window of 0 (Qwen2-MoE's default: none)."""
        nested = self.raw.get("text_config")
        out = []
        for scope in (nested if isinstance(nested, Mapping) else {}, self.raw):
            for field_name, names in _SIZE_NAMES.items():
                for name in names:
                    value = scope.get(name)
                    number = isinstance(value, int | float) and not isinstance(value, bool)
                    if number and field_name != "sliding_window" and _whole(value) is None:
                        out.append(f"{name} is {json.dumps(value)}")
        return [f"{p}, not a whole number above 0" for p in dict.fromkeys(out)]

    @property
    def learned_positions(self) -> bool:
        """Whether positions are a learned table (a longer row indexes past it)."""
        return self.model_type in LEARNED_POSITIONS


def _size(text: Mapping[str, Any], top: Mapping[str, Any], names: tuple[str, ...]) -> int | None:
    """The first whole number above 0 among `names`, in the text config, then the top."""
    for scope in (text, top):
        for name in names:
            value = _whole(scope.get(name))
            if value is not None:
                return value
    return None


def _whole(value: Any) -> int | None:
    """`value` as an int when it is a whole number above 0 (bools are not sizes)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and value > 0 else None


def _first(text: Mapping[str, Any], top: Mapping[str, Any], name: str) -> Any:
    return text[name] if name in text else top.get(name)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
