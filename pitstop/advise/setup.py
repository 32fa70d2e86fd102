"""One view of a training setup, whether it came from a pitstop RunConfig or HF arguments.

The rules read a `Setup` so each rule is written once; `fix()` renders the remedy
in the vocabulary of the source (a pitstop flag, or a TrainingArguments / SFTConfig
field and value).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pitstop.catalog.layouts import Layout
from pitstop.core.config import RunConfig
from pitstop.core.run_record import SOURCE_SCRIPT

# What a field the run did not record reads as, in a Setup and in a finding's evidence: a
# default of TrainingArguments is a guess about a custom loop, never a fact about it.
UNKNOWN = "unknown"
# The note pitstop.anyloop.recorder writes into the profile of a custom loop (`pitstop
# profile -- COMMAND`, pitstop.watch): its settings were observed, not declared.
CUSTOM_LOOP_NOTE = "a custom loop timed by pitstop.watch"


def is_custom_loop(profile: dict[str, Any] | None) -> bool:
    """Whether a profile timed a plain PyTorch loop (its settings observed through hooks):
    its source is "script" (pitstop.anyloop.recorder); a profile written before that field
    said so carries the recorder's note instead."""
    p = profile or {}
    if p.get("program"):  # recorded by the watch: a Trainer script's fixes are its fields
        return p["program"] != "trainer"
    if p.get("source") == SOURCE_SCRIPT:
        return True
    return any(CUSTOM_LOOP_NOTE in str(n) for n in p.get("notes") or [])


@dataclass
class Setup:
    source: str  # "pitstop" | "hf"
    raw: dict[str, Any]  # the values as given (HF: given fields only; pitstop: the whole config)
    hf_class: str | None = None  # "TrainingArguments" | "SFTConfig" (HF only)
    # pitstop: None = pitstop picks from the CPU count; a recorded HF run: None = not recorded
    loader_workers: int | None = None
    # pack | bucket | pad | dynamic (HF: pad to the longest row of a random batch) | auto | unknown
    batching: str = "auto"
    max_len: int | None = None
    max_len_key: str = "max_length"  # HF: the key this file uses for the max length
    precision: str = "auto"  # bf16 | fp16 | fp32 | auto | unknown
    tf32: bool | None = None
    gradient_checkpointing: bool | None = False  # None: not recorded
    # HF optim name; None for pitstop (it picks fused AdamW on CUDA) and for a run that did
    # not record it (`recorded` is set)
    optimizer: str | None = None
    compile: str = "auto"  # on | off | auto | unknown
    attention: str | None = None
    micro_batch_rows: int | None = None
    tokens_per_micro_batch: int | None = None
    grad_accum: int | None = None
    tokens_per_step: int | None = None
    world: int = 1
    save_steps: int | None = None
    log_steps: int | None = None
    eval_steps: int | None = None
    empty_cache_steps: int | None = None
    nan_inf_filter: bool | None = None
    lora: bool = False
    lora_r: int | None = None  # the adapter's rank when the setup says it
    load_in_4bit: bool = False  # the frozen base weights are 4-bit (QLoRA)
    # The transformers release whose field names `fix()` should use (HF only).
    transformers_major: int = 5
    # The fields a profile recorded, when the setup was read from one (None: a declared
    # config, whose absent fields take their documented defaults). A field outside it is
    # None / UNKNOWN here: the run never said what it was.
    recorded: frozenset[str] | None = None
    # A plain PyTorch loop (`pitstop profile -- python loop.py`): fixes name DataLoader and
    # torch arguments, not TrainingArguments fields the loop does not have.
    custom_loop: bool = False
    # What ran the loop, where a profile recorded it (pitstop.anyloop.program): "trainer",
    # "lightning", "accelerate" or "loop"; None for a declared config.
    program: str | None = None

    def fix(
        self, pitstop: str, hf: str, loop: str | None = None, lightning: str | None = None
    ) -> str:
        """The remedy in the setup's own vocabulary, the one place that decides it: a pitstop
        flag, a TrainingArguments / SFTConfig field, `L.Trainer(...)` arguments for a
        Lightning script (`lightning`, else `loop`), or a code line for a loop (`loop`)."""
        if self.source == "pitstop":
            return pitstop
        if self.custom_loop and self.program == "lightning" and lightning is not None:
            return lightning
        return loop if self.custom_loop and loop is not None else hf

    @property
    def rows_per_step(self) -> int | None:
        """Rows per optimizer step across all processes (the effective batch), when fixed."""
        if self.micro_batch_rows is None or self.grad_accum is None:
            return None
        return self.micro_batch_rows * self.grad_accum * self.world

    @property
    def effective_tokens_per_step(self) -> int | None:
        """Positions per optimizer step across all processes, when the config fixes it."""
        if self.tokens_per_step is not None:
            return self.tokens_per_step * (self.world if self.source == "hf" else 1)
        if self.rows_per_step is not None and self.max_len:
            return self.rows_per_step * self.max_len
        return None

    @property
    def group_by_length_fix(self) -> str:
        """transformers 5 replaced `group_by_length=True` with a sampling strategy."""
        if self.transformers_major >= 5 and "group_by_length" not in self.raw:
            return 'train_sampling_strategy="group_by_length"'
        return "group_by_length=True"

    @property
    def packed(self) -> bool:
        """Documents share rows (pitstop's pack; TRL's packing or padding-free)."""
        layout = Layout.lookup(self.batching)
        return layout is not None and layout.packed

    @property
    def pads_to_max_len(self) -> bool:
        """Every row padded to the max length (pitstop's pad)."""
        layout = Layout.lookup(self.batching)
        return layout is not None and layout.padded_to_max_len

    @property
    def batching_is_padded(self) -> bool:
        """Rows padded to max length (pad) or to each batch's longest (HF's `dynamic`)."""
        return self.pads_to_max_len or self.batching == "dynamic"


def from_run_config(cfg: RunConfig) -> Setup:
    """A pitstop RunConfig as a Setup. `auto` values stay `auto`: the probe decides them."""
    compile_ = cfg.compile
    # pitstop's tokens_per_step is the global count (all processes); grad_accum may be derived.
    return Setup(
        source="pitstop",
        raw=cfg.to_dict(),
        loader_workers=cfg.loader_workers,
        batching=cfg.batching,
        max_len=cfg.max_seq_len,
        precision=cfg.precision,
        gradient_checkpointing=cfg.gradient_checkpointing,
        compile=compile_,
        attention=cfg.attention,
        micro_batch_rows=cfg.micro_batch_size,
        tokens_per_micro_batch=cfg.tokens_per_micro_batch,
        grad_accum=cfg.grad_accum,
        tokens_per_step=cfg.tokens_per_step,
        world=cfg.nproc,
        save_steps=cfg.save_steps,
        log_steps=cfg.log_steps,
        eval_steps=cfg.eval_steps if cfg.eval_data else None,
        lora=cfg.lora_r is not None,
        lora_r=cfg.lora_r,
        load_in_4bit=cfg.load_in_4bit,
    )
