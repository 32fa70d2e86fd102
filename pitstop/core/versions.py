"""The torch and transformers versions pitstop supports, and the known-bad ones it refuses.

pitstop passes no attention mask: transformers derives each packed row's documents from
the position restarts. Below the floor that either crashes at model load or, worse,
trains with documents attending to each other while the loss still falls. Each trap
below was confirmed by reading the named transformers source (docs/versions.md has the
file and line of each); the run refuses any that applies, before anything is written,
with the versions found and the fix.

The floor is the oldest pair under which none applies:

- transformers 4.56: ``from_pretrained(dtype=...)`` is popped only from 4.56 on (4.55.4's
  ``modeling_utils`` pops ``torch_dtype`` alone; ``dtype`` reaches the model's
  constructor, a TypeError). It also clears every packed-attention trap below;
- torch 2.6: transformers 4.53-4.57 apply the packed-row mask only when torch >= 2.6
  (``masking_utils``: ``if packed_sequence_mask is not None and
  _is_torch_greater_or_equal_than_2_6``), so with an older torch every row is one causal
  sequence. transformers 5 has no such gate, but pitstop tests no older torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pitstop.catalog.model_config import ModelConfig
from pitstop.core.errors import ConfigError

__all__ = [
    "FLOOR",
    "check_versions",
    "installed_versions",
    "model_type_of",
    "parse_version",
    "version_problems",
]

# The oldest supported releases; pyproject.toml and docs/versions.md state the same.
FLOOR = {"torch": (2, 6), "transformers": (4, 56)}

_UPGRADE = "pip install -U 'torch>=2.6' 'transformers>=4.56'"


def parse_version(text: str) -> tuple[int, ...]:
    """(major, minor, patch) of '2.13.0+cpu', '4.56.0.dev0', '2.6.0a0+git1234' (missing parts 0)."""
    m = re.match(r"\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", text)
    if not m:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(g or 0) for g in m.groups())


@dataclass(frozen=True)
class Trap:
    """transformers in `versions` (and torch below `torch_below`, when set) with `attention`
    (None: every kernel) and `model_type` (None: every model) is known to train wrong or crash.

    `versions` is "LO-HI": from LO up to, not including, HI ("0-4.56": every release before
    4.56), written as one string so each trap is one line of data."""

    versions: str
    what: str
    attention: frozenset[str] | None = None
    model_type: str | None = None
    torch_below: str | None = None

    @property
    def lo(self) -> tuple[int, ...]:
        return parse_version(self.versions.split("-")[0])

    @property
    def hi(self) -> tuple[int, ...]:
        return parse_version(self.versions.split("-")[1])


_NO_FLASH = frozenset({"sdpa", "eager", "flex_attention"})

TRAPS: tuple[Trap, ...] = (
    Trap(
        "0-4.56",
        "pitstop loads models with from_pretrained(dtype=...), which transformers accepts "
        "only from 4.56 (before, the model's constructor raises TypeError)",
    ),
    Trap(
        "0-4.53",
        "transformers before 4.53 does not detect packed rows from position_ids "
        "(no masking_utils.find_packed_sequence_indices): packed documents attend to each other",
        attention=_NO_FLASH,
    ),
    Trap(
        "4.53-4.58",
        "transformers 4.53-4.57 apply the packed-row document mask only with torch >= 2.6: "
        "with this torch, packed documents attend to each other (silently; the loss still falls)",
        attention=_NO_FLASH,
        torch_below="2.6",
    ),
    Trap(
        "4.53.0-4.53.1",
        "flash_attention_2 on transformers 4.53.0 ignores cu_seq_lens when a micro-batch "
        "has more than one row: packed documents attend to each other",
        attention=frozenset({"flash_attention_2"}),
    ),
    Trap(
        "4.48-4.53",
        "flex_attention on transformers 4.48-4.52 gets no block mask and no causal score_mod: "
        "attention is bidirectional (the model sees future tokens)",
        attention=frozenset({"flex_attention"}),
    ),
    Trap(
        "4.46-4.48",
        "Mistral's forward on transformers 4.46-4.47 takes no **kwargs: the flash-attention "
        "document boundaries pitstop passes raise TypeError",
        attention=frozenset({"flash_attention_2"}),
        model_type="mistral",
    ),
)


def version_problems(
    torch_version: str,
    transformers_version: str,
    *,
    attention: str | None = None,
    model_type: str | None = None,
) -> list[str]:
    """Every known problem of this torch + transformers pair ([] when supported).

    `attention` / `model_type`: the run's kernel and model (None: any, so every trap of the
    versions is named). The floor itself is always a problem when not met.
    """
    tv, hv = parse_version(torch_version), parse_version(transformers_version)
    found = f"(found torch {torch_version}, transformers {transformers_version})"
    problems = []
    for trap in TRAPS:
        if not trap.lo <= hv < trap.hi:
            continue
        if trap.torch_below is not None and not tv < parse_version(trap.torch_below):
            continue
        if attention is not None and trap.attention is not None and attention not in trap.attention:
            continue
        if model_type is not None and trap.model_type is not None and model_type != trap.model_type:
            continue
        problems.append(f"{trap.what} {found}; fix: {_UPGRADE}")
    for name, v in (("torch", tv), ("transformers", hv)):
        floor = FLOOR[name]
        if v < floor and not problems:  # a trap already names the versions and the fix
            want = ".".join(map(str, floor))
            problems.append(
                f"{name} {torch_version if name == 'torch' else transformers_version} is older "
                f"than the oldest pitstop supports ({name} >= {want}) {found}; fix: {_UPGRADE}"
            )
    return problems


def installed_versions() -> tuple[str, str]:
    """(torch, transformers) versions of this process."""
    import torch
    import transformers

    return str(torch.__version__), str(transformers.__version__)


def model_type_of(model_dir: str | Path) -> str | None:
    """config.json's model_type (None when absent or unreadable: every model's traps apply)."""
    config = ModelConfig.read_optional(model_dir)
    return config.model_type if config is not None else None


def check_versions(*, attention: str | None = None, model_type: str | None = None) -> None:
    """Refuse (ConfigError, nothing written) a torch + transformers pair known to train
    wrong or crash; see `version_problems`."""
    problems = version_problems(*installed_versions(), attention=attention, model_type=model_type)
    if problems:
        raise ConfigError(
            problems,
            header="these torch/transformers versions are known to crash or train wrong "
            "(docs/versions.md):",
        )
