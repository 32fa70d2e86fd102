"""Settings applied to an unchanged training script from outside, for `pitstop tune -- CMD`.

The boot hook that `pitstop profile -- CMD` installs (`anyloop/boot/sitecustomize.py`) calls
`apply_from_env` when PITSTOP_TRIAL_SETTINGS holds a `TrialSettings` as JSON. It then:

- patches `torch.utils.data.DataLoader.__init__`, so every loader the script builds gets the
  trial's num_workers / pin_memory / persistent_workers / prefetch_factor (a plain loop's
  fixes are its DataLoader arguments);
- patches `transformers.TrainingArguments.__post_init__` (SFTConfig and other subclasses call
  it), so the trial's fields replace the script's before transformers validates them, and
  forces what keeps a trial off the user's files: save_strategy "no", report_to none, no hub
  push, output_dir and logging_dir inside the trial directory, max_steps K;
- stops the process cleanly (`TrialStop`, a SystemExit with status 0) right after the K-th
  optimizer step, from an optimizer-step hook registered after the step timer's, so the
  timer has closed that step and writes the run at exit. A plain loop thus never runs past
  the trial, and a Trainer script never reaches its own `save_model()` / `push_to_hub()`.

What was applied, what was refused and why (bf16 without native bf16, tf32 off CUDA, a
micro-batch that does not divide the script's micro-batch x accumulation) and the script's
own values are written to `applied.json` in the trial directory, each time a patch acts.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ENV_SETTINGS = "PITSTOP_TRIAL_SETTINGS"
APPLIED = "applied.json"  # in the trial directory: what the patches did

# A setting's value as JSON keeps it: what a trial sets and what a script had.
Value = bool | int | float | str | None
LOADER_FIELDS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")
# TrainingArguments fields a trial may set; anything else in a settings file is refused.
ARGS_FIELDS = (
    "dataloader_num_workers",
    "dataloader_pin_memory",
    "dataloader_persistent_workers",
    "dataloader_prefetch_factor",
    "bf16",
    "tf32",
    "gradient_checkpointing",
    "optim",
    "torch_compile",
    "per_device_train_batch_size",
    "group_by_length",
    "packing",
    "padding_free",
)


@dataclass
class TrialSettings:
    """One trial: the overrides, how many optimizer steps it runs, where it may write."""

    trial_dir: str  # everything a trial writes goes under it
    stop_after_steps: int  # optimizer steps (warm-up included), then a clean exit
    loader: dict[str, Value] = field(default_factory=dict)  # DataLoader keyword arguments
    training_args: dict[str, Value] = field(default_factory=dict)  # TrainingArguments fields
    bf16_native: bool = False  # the device computes bf16 natively (decided by the caller)
    autocast: str | None = None  # "bf16": a plain loop's model forward under bf16 autocast

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrialSettings:
        return cls(**json.loads(text))


@dataclass
class Applied:
    """What the patches did in one trial process (written to applied.json)."""

    loaders: int = 0  # DataLoaders built with the trial's arguments
    loader: dict[str, Value] = field(default_factory=dict)  # the arguments they were given
    trainer: bool = False  # the script built TrainingArguments (an HF Trainer / TRL script)
    script_args: dict[str, Value] = field(default_factory=dict)  # its own values, before
    training_args: dict[str, Value] = field(default_factory=dict)  # the fields set
    refused: dict[str, str] = field(default_factory=dict)  # field -> why it was not applied
    stopped_after_steps: int | None = None
    # Written once, after the first optimizer step: a trial stopped at the budget's end
    # (which writes no run) says whether it was stuck before its first step or just slow.
    first_step: bool = False
    autocast: str | None = None  # the autocast dtype the model's forwards ran under

    def write(self, trial_dir: str) -> None:
        path = Path(trial_dir) / APPLIED
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1), encoding="utf-8")
        os.replace(tmp, path)


# How to take the patches out again (tests apply them in their own process).
_UNDO: list[Callable[[], None]] = []


def remove() -> None:
    """Undo `apply`: the original DataLoader and TrainingArguments code, no step limit."""
    while _UNDO:
        _UNDO.pop()()


class TrialStop(SystemExit):
    """Raised after the trial's last optimizer step: a clean exit (status 0) at any depth."""

    def __init__(self) -> None:
        super().__init__(0)


def loader_kwargs(given: dict[str, object], overrides: dict[str, Value]) -> dict[str, object]:
    """The DataLoader keyword arguments with the overrides applied; without workers the
    worker-only arguments go back to their defaults (DataLoader rejects them otherwise)."""
    out = dict(given)
    out.update({k: v for k, v in overrides.items() if k in LOADER_FIELDS})
    if int(out.get("num_workers") or 0) == 0:
        out["persistent_workers"] = False
        out["prefetch_factor"] = None
    return out


def split_batch(micro: int, accum: int, new_micro: int) -> tuple[int, int] | None:
    """(micro-batch, accumulation) with `new_micro` rows and the product unchanged, or None
    when `new_micro` does not divide micro x accumulation (the step would change)."""
    total = micro * accum
    if new_micro <= 0 or total % new_micro:
        return None
    return new_micro, total // new_micro


def training_args_overrides(
    current: dict[str, Value], settings: TrialSettings, *, cuda: bool
) -> tuple[dict[str, Value], dict[str, str]]:
    """(fields to set, refused field -> reason) for a TrainingArguments whose values are
    `current`: the trial's fields where this device allows them, then the safety fields."""
    out: dict[str, Value] = {}
    refused: dict[str, str] = {}
    for key, value in settings.training_args.items():
        if key not in ARGS_FIELDS:
            refused[key] = "not a field pitstop tune sets"
        elif key == "bf16" and value and not settings.bf16_native:
            refused[key] = "the device has no native bf16 (it would be emulated, slower)"
        elif key == "tf32" and value and not cuda:
            refused[key] = "TF32 exists on CUDA GPUs only"
        elif key in ("packing", "padding_free") and key not in current:
            refused[key] = "not a field of this script's config (TRL's SFTConfig has it)"
        elif key == "padding_free" and value and not current.get("packing"):
            # TRL refuses padding_free without packing while max_length is set (it would not
            # be enforced): the trial trains rows whole, which the candidate's label says.
            out["padding_free"] = True
            if current.get("max_length") is not None:
                out["max_length"] = None
        elif key == "per_device_train_batch_size":
            micro = int(current.get("per_device_train_batch_size") or 1)
            accum = int(current.get("gradient_accumulation_steps") or 1)
            split = split_batch(micro, accum, int(value or 0))
            if split is None:
                refused[key] = f"{value} does not divide micro-batch x accumulation {micro * accum}"
            else:
                out["per_device_train_batch_size"], out["gradient_accumulation_steps"] = split
        else:
            out[key] = value
            if key == "gradient_checkpointing" and "activation_checkpointing" in current:
                out["activation_checkpointing"] = value  # its name from transformers 5 on
        if key == "bf16" and key in out:
            out["fp16"] = False  # bf16 replaces fp16; both on is a TrainingArguments error
            if value and not cuda:
                # TrainingArguments refuses bf16 on a machine without a GPU unless told the
                # run is on the CPU (its bf16 is then CPU autocast).
                out["use_cpu"] = True
    if int(out.get("dataloader_num_workers", current.get("dataloader_num_workers")) or 0) == 0:
        out.pop("dataloader_persistent_workers", None)  # only valid with workers
        out.pop("dataloader_prefetch_factor", None)
    hf_out = str(Path(settings.trial_dir) / "hf_output")
    out.update(
        output_dir=hf_out,
        logging_dir=str(Path(hf_out) / "logs"),
        save_strategy="no",
        report_to="none",
        push_to_hub=False,
        load_best_model_at_end=False,
        max_steps=settings.stop_after_steps,
    )
    return out, refused


def apply(settings: TrialSettings) -> Applied:
    """Install the DataLoader and TrainingArguments patches and the step limit."""
    applied = Applied()
    _patch_dataloader(settings, applied)
    _patch_training_args(settings, applied)
    _autocast_forward(settings, applied)
    _stop_after(settings, applied)
    applied.write(settings.trial_dir)
    return applied


def apply_from_env() -> Applied | None:
    """The boot hook's entry: apply PITSTOP_TRIAL_SETTINGS when it is set."""
    text = os.environ.get(ENV_SETTINGS)
    return apply(TrialSettings.from_json(text)) if text else None


def _patch_dataloader(settings: TrialSettings, applied: Applied) -> None:
    from torch.utils.data import DataLoader

    original = DataLoader.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if not settings.loader:
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        given = dict(bound.arguments)
        given.pop("self", None)
        extra = given.pop("kwargs", None) or {}  # a subclass's **kwargs, if any
        new = loader_kwargs(given, settings.loader)
        applied.loaders += 1
        applied.loader = {k: new.get(k) for k in LOADER_FIELDS}
        applied.write(settings.trial_dir)
        return original(self, **new, **extra)

    DataLoader.__init__ = __init__  # type: ignore[method-assign]
    _UNDO.append(lambda: setattr(DataLoader, "__init__", original))


def _patch_training_args(settings: TrialSettings, applied: Applied) -> None:
    try:
        from transformers import TrainingArguments
    except ImportError:  # no transformers: a plain PyTorch script, nothing to patch
        return
    original = TrainingArguments.__post_init__

    @functools.wraps(original)
    def __post_init__(self: Any) -> None:
        import torch

        current = {k: _plain(v) for k, v in vars(self).items() if not k.startswith("_")}
        fields, refused = training_args_overrides(current, settings, cuda=torch.cuda.is_available())
        applied.trainer = True
        applied.script_args = {
            k: _plain(current.get(k))
            for k in (
                *ARGS_FIELDS,
                "activation_checkpointing",
                "gradient_accumulation_steps",
                "fp16",
                "output_dir",
            )
            if k in current
        }
        applied.training_args = {k: _plain(v) for k, v in fields.items()}
        applied.refused.update(refused)
        for k, v in fields.items():
            setattr(self, k, v)
        applied.write(settings.trial_dir)
        return original(self)

    TrainingArguments.__post_init__ = __post_init__  # type: ignore[method-assign]
    _UNDO.append(lambda: setattr(TrainingArguments, "__post_init__", original))


@dataclass
class _AutocastState:
    depth: int = 0  # module calls open (the model's forward is the outermost)
    model: Any = None  # the first module with parameters called outermost with gradients
    ctx: Any = None  # the autocast context the model's forward runs in


def _autocast_forward(settings: TrialSettings, applied: Applied) -> None:
    """A plain loop's precision trial: the model's outermost forward (the first module with
    parameters called outside any other, with gradients enabled) runs under bf16 autocast,
    entered by a forward pre-hook and left by its forward hook. The weights, gradients and
    optimizer state stay fp32; a loss computed inside the forward runs under autocast too
    (autocast keeps it in fp32)."""
    if settings.autocast != "bf16":
        return
    if not settings.bf16_native:
        applied.refused["autocast"] = "the device has no native bf16 (it would be emulated, slower)"
        applied.write(settings.trial_dir)
        return
    import torch
    from torch.nn.modules import module as nn_module

    state = _AutocastState()

    def pre(module: Any, args: Any) -> None:
        if state.depth == 0 and torch.is_grad_enabled():
            if state.model is None and next(module.parameters(), None) is not None:
                state.model = module
                applied.autocast = "bf16"
                applied.write(settings.trial_dir)
            if module is state.model:
                device = next(module.parameters()).device.type
                state.ctx = torch.autocast(device, dtype=torch.bfloat16)
                state.ctx.__enter__()
        state.depth += 1

    def post(module: Any, args: Any, *rest: Any) -> None:
        state.depth = max(0, state.depth - 1)
        if state.depth == 0 and state.ctx is not None:
            ctx, state.ctx = state.ctx, None
            ctx.__exit__(None, None, None)

    handles = [
        nn_module.register_module_forward_pre_hook(pre),
        nn_module.register_module_forward_hook(post, always_call=True),
    ]
    _UNDO.extend(h.remove for h in handles)


def _stop_after(settings: TrialSettings, applied: Applied) -> None:
    """Exit cleanly after the K-th step of the first optimizer that steps (as the timer counts)."""
    from torch.optim import optimizer as optim_module

    state = {"optimizer": None, "steps": 0}

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        if state["optimizer"] is None:
            state["optimizer"] = id(optimizer)
        if id(optimizer) != state["optimizer"]:
            return
        state["steps"] += 1
        if state["steps"] == 1:
            applied.first_step = True
            applied.write(settings.trial_dir)
        if state["steps"] >= settings.stop_after_steps:
            applied.stopped_after_steps = state["steps"]
            applied.write(settings.trial_dir)
            raise TrialStop()

    _UNDO.append(optim_module.register_optimizer_step_post_hook(post).remove)


def _plain(v: Any) -> Value:
    """A value as JSON keeps it (enums by their value, lists as text)."""
    v = getattr(v, "value", v)
    return v if isinstance(v, (bool, int, float, str)) or v is None else str(v)
