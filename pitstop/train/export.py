"""Merged export: a LoRA adapter folded into its base, written as a plain HF model directory.

`pitstop export RUN --merge` and `pitstop train ... --merge-lora` both come here. The
base is the one the adapter names (an absolute path or a Hub id in the local cache),
loaded in fp32 so the merge W + scale * B @ A is computed without rounding, then
saved in the base's dtype (or `dtype`) as safetensors with the run's tokenizer. The
result loads with AutoModelForCausalLM.from_pretrained and needs no peft.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pitstop.core import faults, run_record
from pitstop.core.config import RunConfig
from pitstop.core.errors import ConfigError, MissingDependencyError
from pitstop.core.hub import missing_hint, resolve_model
from pitstop.core.runlock import pid_alive
from pitstop.train.model_io import (
    _DTYPES,
    base_dtype,
    is_peft,
    publish_dir,
    save_final,
    set_config_dtype,
)


def adapter_dir(run_or_adapter: Path) -> Path:
    """The adapter directory of a run directory (its final/) or the adapter directory itself."""
    for d in (run_or_adapter, run_or_adapter / "final"):
        if (d / "adapter_config.json").is_file():
            return d
    if (run_or_adapter / "final" / "config.json").is_file():
        raise ConfigError(
            f"{run_or_adapter} holds a full fine-tuned model, not a LoRA adapter: its final/ "
            "already is a plain Hugging Face model directory, there is nothing to merge"
        )
    if (run_or_adapter / "config.json").is_file():  # a full fine-tune's checkpoint, a model
        raise ConfigError(
            f"{run_or_adapter} holds a full model's weights (config.json, no "
            "adapter_config.json), not a LoRA adapter: there is nothing to merge"
        )
    raise ConfigError(
        f"{run_or_adapter} is neither a pitstop run directory with a LoRA adapter in final/ "
        "nor an adapter directory (no adapter_config.json); give the --output of a LoRA run"
    )


def merge_adapter(run_or_adapter: Path, dest: Path | None = None, dtype: str = "auto") -> Path:
    """Merge the adapter of `run_or_adapter` into its base and write `dest` (default RUN/merged)."""
    try:
        import peft
    except ImportError:
        raise MissingDependencyError(
            "merging a LoRA adapter needs the peft package: pip install 'pitstop[lora]'"
        ) from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = adapter_dir(Path(run_or_adapter))
    if dest is None:
        dest = src.parent / "merged" if src.name == "final" else src.with_name(src.name + "-merged")
    acfg = json.loads((src / "adapter_config.json").read_text(encoding="utf-8"))
    base_name = acfg.get("base_model_name_or_path")
    if not base_name:
        raise ConfigError(
            f"{src}/adapter_config.json names no base model (base_model_name_or_path)"
        )
    base_dir = Path(resolve_model(base_name))
    if not (base_dir / "config.json").is_file():
        raise ConfigError(
            f"the adapter's base model {base_name} is not a model directory here; move the base "
            f"back or set base_model_name_or_path in {src}/adapter_config.json"
            + missing_hint(base_name)
        )
    out_dtype = base_dtype(base_dir) if dtype == "auto" else _DTYPES[dtype]
    # The partial directory comes first: a read-only or full destination fails before the
    # minutes of loading and merging, not after them.
    tmp = partial_dir(dest)
    try:
        base = AutoModelForCausalLM.from_pretrained(
            base_dir, dtype=torch.float32, local_files_only=True, use_safetensors=True
        )
        merged = peft.PeftModel.from_pretrained(base, src).merge_and_unload()
        merged.to(out_dtype)
        merged.save_pretrained(tmp, safe_serialization=True)
        set_config_dtype(tmp, out_dtype)
        AutoTokenizer.from_pretrained(src, local_files_only=True).save_pretrained(tmp)
        faults.from_env().reached("export-write")  # tests: a signal or kill lands here
    except BaseException:  # Ctrl-C or SIGTERM (commands/export.py) included
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, dest)
    return dest


def partial_dir(dest: Path) -> Path:
    """A new `.NAME.partial-PID-HEX` beside `dest`, after removing those of dead writers.

    A write killed by SIGKILL leaves its partial directory behind, a whole model copy
    each time; its pid in the name tells a later writer that nobody fills it any more.
    A `.NAME.old-HEX` is the previous copy a publish had set aside: garbage once `dest`
    exists again. The leading dot keeps any of them from looking like a model.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    for p in dest.parent.glob(f".{dest.name}.partial-*"):
        pid = p.name.rsplit(".partial-", 1)[1].split("-")[0]
        if not pid.isdigit() or not pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
    if dest.exists():
        for p in dest.parent.glob(f".{dest.name}.old-*"):
            shutil.rmtree(p, ignore_errors=True)
    tmp = dest.parent / f".{dest.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    return tmp


def write_final(
    model: Any,
    tokenizer: Any,
    out: Path,
    state: dict[str, Any] | None,
    cfg: RunConfig,
    *,
    before_publish: Callable[[], None],
) -> None:
    """OUT/final/ (HF-loadable; a PEFT adapter for LoRA), written aside and published
    atomically; OUT/merged/ too with --merge-lora. `before_publish` runs between the two
    (the trainer waits there for its last checkpoint: final/ is never published by a
    run that could not save its end)."""
    tmp = partial_dir(out / run_record.FINAL)  # also clears a killed final save's debris
    try:
        save_final(model, tokenizer, tmp, state, cfg)
        # The trainer's Faults are not handed to this function; the environment they were
        # read from gives the same ones (pitstop/core/faults.py reads it, nothing else does).
        faults.from_env().reached("final-write")
        before_publish()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, out / run_record.FINAL)
    if cfg.merge_lora and is_peft(model):
        merge_adapter(out / run_record.FINAL, out / run_record.MERGED)  # a second copy of the base
