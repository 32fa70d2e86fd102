"""`estimate_planned_run`: the estimate of a planned run from what a user knows about it.

The library behind `pitstop estimate` (and the demo): a model directory or a parameter
count, a dataset/store or a token count, a GPU name or a measured profile. Every
problem with the request is reported at once (`estimate_problems`), before anything
is read or prepared. With a measured run (`from_profile`) the model and the amount of
data default to the run's own, read from its summary.json (`run_defaults`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypedDict

from pitstop.batching.settings import value_rows
from pitstop.core import run_record
from pitstop.core.errors import ConfigError, DataError
from pitstop.core.hub import model_dir
from pitstop.core.run_record import RunSummary, read_summary
from pitstop.measure.cost_model import (
    ModelShape,
    shape_from_config,
    shape_from_model_dir,
    shape_from_params,
)
from pitstop.report.estimate import (
    DEFAULT_HEADROOM,
    DEFAULT_SCALING,
    DataTokens,
    Estimate,
    EstimateRequest,
    StepShape,
    data_tokens,
    estimate,
    measured_step,
)
from pitstop.report.gpus import Gpu, custom_gpu, find_gpu, get_gpu
from pitstop.report.measured import Measured, load_measured
from pitstop.report.runs import load_run

PRECISIONS = ("bf16", "fp16", "fp32")
ATTENTIONS = ("sdpa", "flash_attention_2", "flex_attention", "eager")


def estimate_problems(
    *,
    model: str | None,
    params: float | None,
    data: str | None,
    tokens: int | None,
    gpu: str | None,
    from_profile: str | None,
    precision: str | None,
    attention: str,
    lora_r: int | None,
    load_in_4bit: bool,
    gpu_tflops: float | None = None,
    gpu_memory_gib: float | None = None,
) -> list[str]:
    """Every problem with an estimate request, each naming the flag that fixes it."""
    problems: list[str] = []
    # With --from-profile the run's summary may name the model and its trained tokens:
    # `estimate_planned_run` reads them, and says what is missing if it does not.
    if not model and params is None and not from_profile:
        problems.append("give --model DIR (exact) or --params N (a rough Llama-shaped guess)")
    if model:
        try:
            model_dir(model)
        except ConfigError as e:
            problems += e.problems
    if data and tokens is not None:
        problems.append("give --data or --tokens, not both")
    if not data and tokens is None and not from_profile:
        problems.append("give --data FILE_OR_STORE or --tokens T: how much data the run sees")
    custom = gpu_tflops is not None or gpu_memory_gib is not None
    if not gpu and not from_profile and not custom:
        problems.append("give --gpu NAME (with an optional --mfu) or --from-profile PROFILE")
    if precision is not None and precision not in PRECISIONS:
        problems.append(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if attention not in ATTENTIONS:
        problems.append(f"--attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    if load_in_4bit and lora_r is None:
        problems.append(
            "--load-in-4bit trains a LoRA adapter on frozen 4-bit weights; add --lora-r R"
        )
    if gpu or custom:
        try:
            _device(gpu, gpu_tflops, gpu_memory_gib, None)
        except ConfigError as e:
            problems += e.problems
    return problems


def _device(
    gpu: str | None, tflops: float | None, memory_gib: float | None, price: float | None
) -> Gpu | None:
    """The table's --gpu, or the user's own card (--gpu-tflops / --gpu-memory-gib)."""
    if tflops is not None or memory_gib is not None:
        return custom_gpu(gpu, tflops, memory_gib, price)
    return get_gpu(gpu) if gpu else None


class PlanSettings(TypedDict, total=False):
    """The plan settings a measured run recorded (each only when it did), and what
    `estimate --from-profile` adds: the row length or accumulation its steps showed, and
    the run's model."""

    gradient_checkpointing: bool
    max_seq_len: int
    micro_batch_size: int
    lora_r: int
    load_in_4bit: bool
    optimizer: str
    measured_seq_len: int
    grad_accum: int
    model: str


def profile_settings(profile: Measured | None) -> PlanSettings:
    """The plan a measured run ran with (its config: pitstop's RunConfig or HF arguments):
    gradient checkpointing, micro-batch rows, row length, LoRA rank, 4-bit, optimizer.
    Only what the run recorded; `estimate --from-profile` keeps these unless told otherwise."""
    cfg = profile.config if profile else None
    if not isinstance(cfg, dict):
        return {}
    out: PlanSettings = {}
    ck = cfg.get("gradient_checkpointing", cfg.get("activation_checkpointing"))
    if ck is not None:
        out["gradient_checkpointing"] = bool(ck)
    seq = next(
        (cfg[k] for k in ("max_seq_len", "max_length", "max_seq_length") if cfg.get(k)), None
    )
    if isinstance(seq, int) and seq > 0:
        out["max_seq_len"] = seq
    rows = cfg.get("micro_batch_size") or cfg.get("per_device_train_batch_size")
    if not rows and cfg.get("tokens_per_micro_batch") and seq:
        rows = max(1, int(cfg["tokens_per_micro_batch"]) // int(seq))
    if not rows:  # pitstop's auto micro-batch: the choice the run recorded ("2 rows")
        got = (profile.choices if profile else {}).get("micro_batch") or {}
        rows = value_rows(got.get("value")) if isinstance(got, dict) else None
    if isinstance(rows, int) and rows > 0:
        out["micro_batch_size"] = rows
    if isinstance(cfg.get("lora_r"), int):
        out["lora_r"] = cfg["lora_r"]
        out["load_in_4bit"] = bool(cfg.get("load_in_4bit"))
    optim = str(cfg.get("optimizer") or cfg.get("optim") or "")
    if optim:
        out["optimizer"] = "adamw_8bit" if "8bit" in optim else "adamw"
    return out


def _describe_kept(kept: PlanSettings) -> str:
    names = {
        "model": lambda v: f"model {v}",
        "gradient_checkpointing": lambda v: f"gradient checkpointing {'on' if v else 'off'}",
        "micro_batch_size": lambda v: f"micro-batch {v} rows",
        "max_seq_len": lambda v: f"rows of {v} tokens",
        "lora_r": lambda v: f"LoRA r={v}",
        "load_in_4bit": lambda v: "4-bit base" if v else "",
        "optimizer": lambda v: f"optimizer {v}",
        "measured_seq_len": lambda v: f"rows of {v:,} positions (padded tokens ÷ rows)",
        "grad_accum": lambda v: f"accumulation of {v} micro-batch(es) per step",
    }
    parts = [names[k](v) for k, v in kept.items() if k in names and names[k](v)]
    return (
        "kept from the measured run: " + ", ".join(parts) + " (flags such as --model, "
        "--micro-batch-size, --max-seq-len, --no-gradient-checkpointing, --optimizer change them)"
    )


def run_summary(profile: Measured) -> RunSummary | None:
    """The summary.json of the run a measured profile came from: the file itself, the one
    beside a run's pitstop_profile.json, or a killed run's rebuilt from metrics.jsonl.
    None for a profile.json of its own (`pitstop profile --output FILE`)."""
    p = Path(profile.path)
    try:
        if p.name == run_record.SUMMARY:
            return read_summary(p)
        if p.name == run_record.METRICS:
            return load_run(p.parent).summary
        if p.name == run_record.HF_PROFILE and (p.parent / run_record.SUMMARY).is_file():
            return read_summary(p.parent / run_record.SUMMARY)
    except DataError:
        return None  # load_measured read the rate; what else the run says is optional
    return None


def run_step(profile: Measured, summary: RunSummary | None) -> StepShape | None:
    """The measured run's optimizer step: `measured_step`, with what its config left out
    taken from the summary's counts (rows per micro-batch, positions per row,
    accumulation), so a plain loop whose config names none of them keeps its own too."""
    step = measured_step(profile)
    if step is None or summary is None:
        return step
    steps, rows, padded = summary.optimizer_steps, summary.rows, summary.padded_tokens
    seq, mbs, accum = step.seq_len, step.rows, step.accumulation
    if seq is None and rows and padded:
        seq = max(1, round(padded / rows))
    rows_per_step = rows / steps if rows and steps else None
    if mbs is None and rows_per_step and accum:
        mbs = max(1, round(rows_per_step / accum))
    if accum is None and rows_per_step and mbs:
        accum = max(1, round(rows_per_step / mbs))
    return replace(step, seq_len=seq, rows=mbs, accumulation=accum)


def _config_model(cfg: object) -> str | None:
    """The model a run's config names: pitstop's `model`, a Trainer's `model_name_or_path`."""
    if not isinstance(cfg, dict):
        return None
    names = ("model", "model_name_or_path", "_name_or_path")
    return next((str(cfg[k]) for k in names if cfg.get(k)), None)


def run_defaults(
    profile: Measured, summary: RunSummary | None
) -> tuple[str | None, DataTokens | None]:
    """The model directory and the amount of data a measured run names, where it does.

    The model: the run's config (`pitstop train`'s `model`, a Trainer's
    `model_name_or_path`), else, for a plain loop, an argument of its recorded command
    that is a model directory (holds config.json). The data: the trained tokens the run
    trained, so without --tokens/--data the estimate is the same run on the target device.
    """
    if summary is None:  # a profile.json of its own (`pitstop profile --output FILE`)
        return _config_model(profile.config), None
    model = _config_model(summary.config)
    if model is None and summary.command:
        cwd = Path(summary.command_cwd or ".")
        for arg in summary.command[1:]:
            d = cwd / str(arg)
            if not str(arg).startswith("-") and (d / "config.json").is_file():
                model = str(d)
                break
    trained, seen, padded = summary.trained_tokens, summary.seen_tokens, summary.padded_tokens
    if not trained:
        return model, None
    eff = seen / padded if seen and padded else None  # a ratio: the same on every rank
    # The whole run's tokens: a writer that counted rank 0's batches saw 1/world of them.
    scale = summary.whole_run_factor
    trained, seen = trained * scale, (seen * scale if seen else seen)
    tokens = DataTokens(
        int(seen or trained),
        int(trained),
        eff,
        None,
        f"the measured run's own {trained:,.0f} trained tokens ({profile.path}; give --tokens "
        "T or --data for another amount)",
    )
    return model, tokens


def estimate_planned_run(
    *,
    model: str | None = None,
    params: float | None = None,
    data: str | None = None,
    tokens: int | None = None,
    epochs: float = 1.0,
    max_seq_len: int | None = None,
    from_profile: str | None = None,
    gpu: str | None = None,
    mfu: float | None = None,
    gpu_counts: Sequence[int] = (1, 2, 4, 8),
    scaling: float = DEFAULT_SCALING,
    price: float | None = None,
    lora_r: int | None = None,
    load_in_4bit: bool = False,
    micro_batch_size: int | None = None,
    precision: str | None = None,
    attention: str = "sdpa",
    gradient_checkpointing: bool | None = None,
    headroom: float = DEFAULT_HEADROOM,
    cache_dir: str | None = None,
    gpu_tflops: float | None = None,
    gpu_memory_gib: float | None = None,
    optimizer: str | None = None,
    save_steps: int | None = None,
    tokens_per_step: int | None = None,
    disk_write_gbps: float | None = None,
) -> Estimate:
    """Memory, time and cost of a planned run (ConfigError listing every problem first).

    `precision` None picks bf16 (fp16 on a GPU without bf16; for a CPU profile, the
    precision that run recorded, else fp32). With `from_profile`, a setting left None (micro-batch,
    row length, gradient checkpointing, LoRA, optimizer) is the measured run's own."""
    return _estimate(
        _PlannedRun(
            model=model,
            params=params,
            data=data,
            tokens=tokens,
            epochs=epochs,
            max_seq_len=max_seq_len,
            from_profile=from_profile,
            gpu=gpu,
            mfu=mfu,
            gpu_counts=tuple(gpu_counts),
            scaling=scaling,
            price=price,
            lora_r=lora_r,
            load_in_4bit=load_in_4bit,
            micro_batch_size=micro_batch_size,
            precision=precision,
            attention=attention,
            gradient_checkpointing=gradient_checkpointing,
            headroom=headroom,
            cache_dir=cache_dir,
            gpu_tflops=gpu_tflops,
            gpu_memory_gib=gpu_memory_gib,
            optimizer=optimizer,
            save_steps=save_steps,
            tokens_per_step=tokens_per_step,
            disk_write_gbps=disk_write_gbps,
        )
    )


@dataclass(frozen=True)
class _PlannedRun:
    """`estimate_planned_run`'s arguments as one record: what the user asked, before
    a measured run fills in what they left out."""

    model: str | None
    params: float | None
    data: str | None
    tokens: int | None
    epochs: float
    max_seq_len: int | None
    from_profile: str | None
    gpu: str | None
    mfu: float | None
    gpu_counts: tuple[int, ...]
    scaling: float
    price: float | None
    lora_r: int | None
    load_in_4bit: bool
    micro_batch_size: int | None
    precision: str | None
    attention: str
    gradient_checkpointing: bool | None
    headroom: float
    cache_dir: str | None
    gpu_tflops: float | None
    gpu_memory_gib: float | None
    optimizer: str | None
    save_steps: int | None
    tokens_per_step: int | None
    disk_write_gbps: float | None

    def problems(self) -> list[str]:
        return estimate_problems(
            model=self.model,
            params=self.params,
            data=self.data,
            tokens=self.tokens,
            gpu=self.gpu,
            from_profile=self.from_profile,
            precision=self.precision,
            attention=self.attention,
            lora_r=self.lora_r,
            load_in_4bit=self.load_in_4bit,
            gpu_tflops=self.gpu_tflops,
            gpu_memory_gib=self.gpu_memory_gib,
        )


@dataclass(frozen=True)
class _MeasuredRun:
    """The measured run of --from-profile (all None without one) and what the estimate
    takes from it: its step, and the model and data the user left out."""

    profile: Measured | None = None
    step: StepShape | None = None
    model: str | None = None  # the model directory to price: the user's, else the run's
    run_model: str | None = None  # the run's model, where the user named none
    tokens: DataTokens | None = None  # the run's own trained tokens, where no data was given
    shape: ModelShape | None = None  # a model without a directory: read off its layers


def _estimate(ask: _PlannedRun) -> Estimate:
    """The steps of `estimate_planned_run`: every problem with the request at once, the
    device, the measured run, the settings kept from it, then the estimate."""
    problems = ask.problems()
    if problems:
        raise ConfigError(problems, header=f"invalid estimate ({len(problems)} problem(s)):")
    device = _device(ask.gpu, ask.gpu_tflops, ask.gpu_memory_gib, ask.price)
    run = _measured_run(ask)
    kept = _kept_settings(ask, run)
    max_seq_len = kept.get("max_seq_len", kept.get("measured_seq_len", ask.max_seq_len))
    model = run.model
    if model:
        shape = shape_from_model_dir(model)
    elif run.shape is not None:
        shape = run.shape
    else:
        assert ask.params is not None  # _measured_run checked it
        shape = shape_from_params(float(ask.params))
    toks = run.tokens or data_tokens(
        ask.data, ask.tokens, model_dir=model, max_seq_len=max_seq_len, cache_dir=ask.cache_dir
    )
    request = EstimateRequest(
        tokens=toks,
        epochs=ask.epochs,
        seq_len=max_seq_len,
        micro_batch_size=int(kept.get("micro_batch_size", ask.micro_batch_size or 1)),
        precision=_precision(ask.precision, device, run.profile),
        attention=ask.attention,
        gradient_checkpointing=bool(kept.get("gradient_checkpointing", ask.gradient_checkpointing)),
        lora_r=kept.get("lora_r", ask.lora_r),
        load_in_4bit=bool(kept.get("load_in_4bit", ask.load_in_4bit)),
        gpu=device,
        mfu=ask.mfu,
        profile=run.profile,
        step=run.step,
        grad_accum=kept.get("grad_accum"),
        gpu_counts=list(ask.gpu_counts),
        scaling=ask.scaling,
        price=ask.price,
        headroom=ask.headroom,
        optimizer=kept.get("optimizer", ask.optimizer or "adamw"),
        save_steps=ask.save_steps,
        tokens_per_step=ask.tokens_per_step,
        disk_write_gbps=ask.disk_write_gbps,
        kept_from_profile=_describe_kept(kept) if kept else None,
    )
    return estimate(shape, request)


def _measured_run(ask: _PlannedRun) -> _MeasuredRun:
    """Read --from-profile: the run's step, and its model and trained tokens where the user
    gave none; the model directory resolved (a Hub id to its snapshot). A ConfigError
    lists what the run cannot supply (no model named, no trained tokens, a model not here)."""
    profile = load_measured(ask.from_profile) if ask.from_profile else None
    summary = run_summary(profile) if profile is not None else None
    step = run_step(profile, summary) if profile is not None else None
    model, run_model, run_tokens = ask.model, None, None
    if profile is not None and not model and ask.params is None:
        model = run_model = run_defaults(profile, summary)[0]
    if profile is not None and not ask.data and ask.tokens is None:
        run_tokens = run_defaults(profile, summary)[1]
    shape = recorded_shape(summary) if not model and ask.params is None else None
    missing = []
    if not model and ask.params is None and shape is None:
        missing.append(
            f"--from-profile {ask.from_profile}: the run names no model directory; "
            "give --model DIR (exact) or --params N (a rough Llama-shaped guess)"
        )
    if not ask.data and ask.tokens is None and run_tokens is None:
        missing.append(
            f"--from-profile {ask.from_profile}: the run records no trained tokens; give --data "
            "FILE_OR_STORE or --tokens T: how much data the run sees"
        )
    if model:  # a directory, or a Hub id's snapshot in the local cache
        try:
            model = model_dir(model)
        except ConfigError as e:
            if not run_model:
                raise
            missing.append(
                f"--from-profile {ask.from_profile}: the run's model is not here "
                f"({e.problems[0]}; moved, or measured on another machine?); give --model DIR "
                "or --params N"
            )
    if missing:
        raise ConfigError(missing, header=f"invalid estimate ({len(missing)} problem(s)):")
    return _MeasuredRun(profile, step, model, run_model, run_tokens, shape)


def recorded_shape(summary: RunSummary | None) -> ModelShape | None:
    """The shape of a profiled model that has no directory (a plain loop's own `nn.Module`),
    as the watch read it off its layers (summary.json's profile.model_shapes), or None.
    Heads are not recorded: 64-wide heads are assumed (they change only the attention
    memory's estimate, not the FLOPs)."""
    shapes = (summary.profile or {}).get("model_shapes") if summary is not None else None
    if not isinstance(shapes, dict) or not shapes.get("num_hidden_layers"):
        return None
    hidden = int(shapes.get("hidden_size") or 0)
    config = {**shapes, "num_attention_heads": max(1, hidden // 64)}
    try:
        return shape_from_config(config, source="the profiled model's layers")
    except DataError:
        return None


def _kept_settings(ask: _PlannedRun, run: _MeasuredRun) -> PlanSettings:
    """The measured run's plan settings the user did not give (a flag given wins), with
    its step's row length and accumulation where its config named none, and its model."""
    given = {
        "gradient_checkpointing": ask.gradient_checkpointing,
        "micro_batch_size": ask.micro_batch_size,
        "max_seq_len": ask.max_seq_len,
        "lora_r": ask.lora_r,
        "optimizer": ask.optimizer,
    }
    settings = profile_settings(run.profile)
    if run.step is not None:
        # The step's row length and accumulation as measured, where the config named none.
        if run.step.seq_len and "max_seq_len" not in settings:
            settings["measured_seq_len"] = run.step.seq_len
        if run.step.accumulation:
            settings["grad_accum"] = run.step.accumulation
    if given["max_seq_len"] is not None:
        settings.pop("measured_seq_len", None)
    kept = PlanSettings(**{k: v for k, v in settings.items() if given.get(k) is None})
    if run.run_model:
        kept["model"] = run.run_model
    if "lora_r" not in kept:
        kept.pop("load_in_4bit", None)
    return kept


def _precision(asked: str | None, device: Gpu | None, profile: Measured | None) -> str:
    """The precision asked, else bf16 (fp16 on a GPU without bf16); for a CPU profile the
    precision that run trained in (bf16 or fp32), else fp32."""
    if asked is not None:
        return asked
    dev = device or (find_gpu(profile.device) if profile else None)
    if dev is not None:
        return "bf16" if dev.bf16 else "fp16"
    if profile is not None:  # a CPU profile: the precision that run trained in
        ran = profile.choices.get("precision")
        ran = ran.get("value") if isinstance(ran, dict) else None
        return ran if ran in ("bf16", "fp32") else "fp32"
    return "bf16"
