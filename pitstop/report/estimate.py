"""`pitstop estimate`: memory, time and cost of a planned run, each with its basis.

Time = work ÷ throughput (+ one-off start-up when a measured run shows it):

* measured (--from-profile): the profile's or run summary's `tokens_per_second`
  (trained tokens per second, as `pitstop train` defines it) divides the planned
  trained tokens × epochs. A run summary's `train_seconds` spans first step to last,
  so checkpoint and eval pauses taken during it are already inside the measured rate;
  its start-up (`wall_seconds - train_seconds`) is added once.
* computed (--gpu NAME): positions per second = MFU × peak FLOP/s ÷ training FLOPs
  per position, with FLOPs per position from `pitstop.measure.cost_model` (the doctor's
  too): (6·N_trainable + 4·N_frozen + 12·L·d·T; PaLM appendix B) and the dense peak from
  the GPU catalogue (`pitstop.catalog.gpus`). MFU is the user's --mfu, else one measured on a
  GPU by the profile, else DEFAULT_MFU, an assumption and labelled so.
  Positions = tokens ÷ packing efficiency when the data's statistics give it.
* a measured run moved to another device (--from-profile with another --gpu, or --mfu):
  only the device work scales (the computed rate above for forward, backward and the
  optimizer step); the run's host time (data wait, host-to-device copies, checkpoint,
  eval, logging and everything else outside those three phases) does not get faster on
  a faster GPU and is kept as measured, per trained token (`host_time`). Its start-up is
  kept too.

The optimizer step of a measured run (trained tokens per step, micro-batch rows, row
length, accumulation: `StepShape`) is kept on either path unless a flag changes it, so
the step count (and the checkpoint count with it) is the run's own.

Cost = hours × GPUs × price per GPU-hour (the user's price, else an example price
from the GPU catalogue, labelled as an example with its date).

Options for 1, 2, 4, 8 GPUs: throughput(n) = throughput(1) · n · e^log2(n), e being
the stated scaling efficiency kept per doubling (default 0.9, --scaling-efficiency).
DDP when the model fits one GPU (plus one gradient-sized bucket buffer that DDP
allocates), FSDP (full sharding) when it does not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypedDict

from pitstop.core.config import build_config
from pitstop.core.errors import ConfigError, DataError
from pitstop.data.prepare import prepare_data
from pitstop.data.store import is_store, read_manifest
from pitstop.measure.cost_model import (
    ASSUMED_WRITE_BYTES_PER_SECOND,
    CUDA_CONTEXT_BYTES,
    DEFAULT_HEADROOM,
    FlopsModel,
    MemoryEstimate,
    ModelShape,
    Plan,
    PlanCost,
    checkpoint_bytes,
    estimate_memory,
    max_micro_batch,
    plan_cost,
    sharded,
)
from pitstop.measure.machine import describe_load
from pitstop.report.gpus import PRICES_SOURCE, GiB, Gpu, find_gpu
from pitstop.report.measured import Measured

# Assumed MFU when nothing was measured. 0.35 is a typical well-tuned single-node
# fine-tuning figure for bf16 on A100/H100-class GPUs (PaLM reports 46% at scale;
# Llama-style fine-tunes with HF + flash attention commonly land around 30-45%).
# An assumption, labelled as such wherever it is used; measure with --from-profile.
DEFAULT_MFU = 0.35
DEFAULT_SCALING = 0.9  # fraction of linear speed-up kept per doubling of GPUs
# A floor under the FLOPs time: every micro-step launches its kernels, and every
# optimizer step walks all parameters, whatever the FLOPs. An ASSUMPTION (not measured
# on these cards), stated in the output when it decides the time: a small model on a
# large GPU is bound by it, not by its FLOPs.
STEP_FLOOR_SECONDS = 0.005
# The phases a step spends on the GPU's work. Every other phase (data_wait,
# host_to_device, checkpoint, eval, logging, other) is host-side: the CPU, the disk or
# the PCIe link does it, so a faster GPU does not shorten it and an estimate for another
# device keeps it as measured. host_to_device is a copy over the link, bound by its
# bandwidth, not by the GPU's FLOP/s.
DEVICE_PHASES = ("forward", "backward", "optimizer")


@dataclass
class StepShape:
    """A measured run's optimizer step: what `estimate --from-profile` keeps by default."""

    trained_tokens: float  # trained tokens per optimizer step
    # rows per micro-batch as measured (a fact about the past run; the estimate's own
    # micro-batch is `micro_batch_size`, decided from it or from the flag)
    rows: int | None = None
    seq_len: int | None = None  # positions per row
    accumulation: int | None = None  # micro-batches per optimizer step
    source: str = "the measured run"

    def describe(self) -> str:
        parts = []
        if self.rows:
            parts.append(f"{self.rows} row(s)")
        if self.seq_len:
            parts.append(f"{self.seq_len:,} positions")
        if self.accumulation:
            parts.append(f"{self.accumulation} micro-batch(es)")
        shape = " × ".join(parts)
        return f"{self.trained_tokens:,.0f} trained tokens per step" + (
            f" ({shape})" if shape else ""
        )


@dataclass
class HostTime:
    """A measured run's host-side time: seconds per trained token, by phase."""

    per_token: dict[str, float]  # host phase -> seconds per trained token
    share: float  # host seconds ÷ all phase seconds of the measured steps
    device_share: float  # forward + backward + optimizer ÷ all phase seconds

    @property
    def seconds_per_token(self) -> float:
        return sum(self.per_token.values())


@dataclass
class DataTokens:
    """How much data a run sees per epoch, and where that number came from."""

    tokens: int  # input tokens (not padding) per epoch
    trained_tokens: int  # tokens carrying loss per epoch
    packing_efficiency: float | None
    max_seq_len: int | None
    basis: str


@dataclass
class Throughput:
    trained_tokens_per_second: float | None  # measured path
    positions_per_second: float | None  # computed path
    mfu: float | None
    startup_seconds: float
    basis: str
    device: str | None = None


class OptionRow(TypedDict):
    """One row of the options table: a GPU count, its strategy, memory, time and cost."""

    gpus: int
    strategy: str
    memory_per_gpu_bytes: int | None
    fits: bool | None
    speedup: float
    train_seconds: float
    hours: float
    cost: float | None
    verdict: str


class MemoryOption(TypedDict):
    """A change that lowers the peak memory, with its peak and whether it fits."""

    flags: str
    changes: str
    peak_bytes: int
    fits: bool


class CheckpointOverhead(TypedDict):
    """The modelled time the run's saves add (`checkpoint_overhead`)."""

    saves: int
    bytes_per_save: int
    seconds_per_save: float
    write_bytes_per_second: float
    bandwidth_assumed: bool
    added_seconds: float
    basis: str


class HostAndDevice(TypedDict):
    """A measured run moved to another device: its host time kept, its device time scaled."""

    host_seconds: float
    device_seconds: float
    host_seconds_per_step: float
    device_seconds_per_step: float
    host_share_measured: float
    host_phases_seconds_per_step: dict[str, float]
    basis: str


@dataclass(frozen=True)
class EstimateRequest:
    """What `estimate` is asked about a model shape: the data, the plan, the device, the price.

    None for seq_len, micro_batch_size and grad_accum: the measured step's own (`step`,
    default `measured_step(profile)`), else the data's row length, 1 row, no accumulation."""

    tokens: DataTokens
    epochs: float = 1.0
    seq_len: int | None = None
    micro_batch_size: int | None = None
    precision: str = "bf16"
    attention: str = "sdpa"
    gradient_checkpointing: bool = False
    lora_r: int | None = None
    load_in_4bit: bool = False
    gpu: Gpu | None = None
    mfu: float | None = None
    profile: Measured | None = None
    step: StepShape | None = None
    grad_accum: int | None = None
    gpu_counts: Sequence[int] | None = None
    scaling: float = DEFAULT_SCALING
    price: float | None = None
    headroom: float = DEFAULT_HEADROOM
    optimizer: str = "adamw"
    save_steps: int | None = None
    tokens_per_step: int | None = None
    disk_write_gbps: float | None = None
    kept_from_profile: str | None = None


@dataclass
class Estimate:
    memory: MemoryEstimate | None
    max_micro_batch: int | None
    gpu: Gpu | None
    usable_bytes: int | None
    train_seconds: float
    time_basis: str
    tokens: DataTokens
    epochs: float
    price: float | None
    price_basis: str
    options: list[OptionRow]
    flops_per_token: float | None
    throughput: Throughput
    assumptions: list[str] = field(default_factory=list)
    lora: bool = False
    gradient_checkpointing: bool = False
    # When the plan does not fit one GPU: what would, cheapest first (`memory_options`).
    memory_options: list[MemoryOption] = field(default_factory=list)
    optimizer_steps: int | None = None
    steps_basis: str = ""
    # The modelled checkpoint overhead (save_steps × checkpoint bytes ÷ write bandwidth).
    checkpoints: CheckpointOverhead | None = None
    # A measured run on another device: its host time kept, its device time scaled.
    split: HostAndDevice | None = None

    def to_dict(self) -> dict[str, Any]:
        mem = None
        if self.memory is not None:
            mem = {
                **{f"{k}_bytes": v for k, v in self.memory.parts().items()},
                "peak_bytes": self.memory.peak,
                "micro_batch_size": self.memory.micro_batch_size,
                "seq_len": self.memory.seq_len,
                "precision": self.memory.precision,
                "trainable_params": self.memory.trainable_params,
                "total_params": self.memory.total_params,
                "gpu": self.gpu.name if self.gpu else None,
                "usable_bytes": self.usable_bytes,
                "fits": self.memory.peak <= self.usable_bytes if self.usable_bytes else None,
                "max_micro_batch_size": self.max_micro_batch,
                "assumptions": self.memory.assumptions,
            }
        hours = self.train_seconds / 3600
        return {
            "memory": mem,
            "time": {
                "train_seconds": round(self.train_seconds, 1),
                "hours": round(hours, 3),
                "basis": self.time_basis,
                "epochs": self.epochs,
                "tokens_per_epoch": self.tokens.tokens,
                "trained_tokens_per_epoch": self.tokens.trained_tokens,
                "tokens_basis": self.tokens.basis,
                "flops_per_token": self.flops_per_token,
                "mfu": self.throughput.mfu,
                "startup_seconds": self.throughput.startup_seconds,
                "optimizer_steps": self.optimizer_steps,
                "optimizer_steps_basis": self.steps_basis,
                "checkpoints": self.checkpoints,
                "host_and_device": self.split,
            },
            "cost": {
                "price_per_gpu_hour": self.price,
                "price_basis": self.price_basis,
                "total": round(hours * self.price, 4) if self.price is not None else None,
                "currency": "USD" if self.price is not None else None,
            },
            "options": self.options,
            "memory_options": self.memory_options,
            "assumptions": self.assumptions,
        }


def data_tokens(
    data: str | None,
    tokens: int | None,
    *,
    model_dir: str | None = None,
    max_seq_len: int | None = None,
    cache_dir: str | None = None,
) -> DataTokens:
    """Tokens per epoch from --tokens, a token store's manifest, or a dataset file (prepared)."""
    if tokens is not None:
        return DataTokens(
            tokens, tokens, None, None, f"--tokens {tokens:,} (taken as trained tokens)"
        )
    if data is None:
        raise ConfigError("give --data FILE_OR_STORE or --tokens T: how much data the run sees")
    path = Path(data)
    if is_store(path):
        manifest = read_manifest(path)
        stats = manifest.get("stats", {})
        where = f"token store {path}"
    elif path.is_file():
        if model_dir is None:
            raise ConfigError(
                f"--data {data} is a dataset file: counting its tokens needs the tokenizer, "
                "give --model DIR (or prepare it first and pass the token store)"
            )
        values: dict[str, Any] = {"data": [str(path)], "model": model_dir}
        if max_seq_len:
            values["max_seq_len"] = max_seq_len
        if cache_dir:
            values["cache_dir"] = cache_dir
        prep = prepare_data(build_config(values, command="prepare"), progress=False)
        stats = prep.stats
        manifest = {"n_tokens": stats.get("tokens")}
        where = f"{path}, prepared into {prep.store_path}"
    else:
        raise DataError(f"--data {data} is neither a dataset file nor a token store directory")
    n = int(stats.get("tokens") or manifest.get("n_tokens") or 0)
    if n <= 0:
        raise DataError(f"{where}: no token count in its statistics")
    trained = int(stats.get("target_tokens") or n)
    eff = (stats.get("packing") or {}).get("efficiency")
    msl = stats.get("max_seq_len") or manifest.get("max_seq_len")
    return DataTokens(
        n,
        trained,
        float(eff) if eff else None,
        int(msl) if msl else None,
        f"{where}: {n:,} tokens, {trained:,} carry loss"
        + (f", packing fills {eff:.1%} of positions" if eff else ""),
    )


def _fused_optimizer(profile: Measured | None, gpu: Gpu | None) -> bool:
    """Whether the priced optimizer is fused: a GPU plan's is; a CPU profile's as recorded."""
    if gpu is not None or profile is None or not _is_cpu(profile.device):
        return True
    recorded = profile.choices.get("optimizer")
    return isinstance(recorded, dict) and "fused" in str(recorded.get("value", ""))


def _is_cpu(device: str) -> bool:
    return device.lower().startswith("cpu")


def host_time(profile: Measured) -> HostTime | None:
    """The measured run's host time per trained token, from its time breakdown.

    The breakdown and the rate cover the same steps (a summary: the whole run; a
    profile.json: its measured steps), so host seconds per trained token = host share ÷
    trained tokens per second. Per token, not per step: loading is paid per row, and a
    plan with another step size pays it for the same rows. None when the breakdown does
    not separate device work (no phases, or none in forward/backward/optimizer: a loop
    whose dataloader or model could not be timed), so nothing can be said about the split.
    """
    tb = {
        str(k): float(v)
        for k, v in profile.time_breakdown.items()
        if isinstance(v, (int, float)) and math.isfinite(v) and v > 0
    }
    total = sum(tb.values())
    device = sum(tb.get(k, 0.0) for k in DEVICE_PHASES)
    if total <= 0 or device <= 0 or not profile.tokens_per_second:
        return None
    per_token = {
        k: v / total / float(profile.tokens_per_second)
        for k, v in tb.items()
        if k not in DEVICE_PHASES
    }
    return HostTime(per_token, 1.0 - device / total, device / total)


def measured_step(profile: Measured | None) -> StepShape | None:
    """A measured run's step from what `Measured` holds: its trained tokens per step, and
    the micro-batch rows, row length and accumulation its config recorded (pitstop's
    RunConfig names or TrainingArguments'). None without a recorded tokens-per-step."""
    per = _measured_tokens_per_step(profile)
    if per is None or profile is None:
        return None
    cfg = profile.config or {}

    def count(*names: str) -> int | None:
        v = next((cfg[n] for n in names if cfg.get(n)), None)
        return v if isinstance(v, int) and v > 0 else None

    rows = count("micro_batch_size", "per_device_train_batch_size")
    seq = count("max_seq_len", "max_length", "max_seq_length")
    accum = count("grad_accum", "gradient_accumulation_steps")
    if accum is None and rows and seq and isinstance(cfg.get("tokens_per_step"), int):
        accum = max(1, cfg["tokens_per_step"] // (rows * seq))  # pitstop: fixed by tokens
    return StepShape(per, rows, seq, accum, str(profile.path))


def throughput(
    *,
    profile: Measured | None,
    gpu: Gpu | None,
    mfu: float | None,
    precision: str,
    flops_per_token: float | None,
    device_share: float | None = None,
) -> Throughput:
    """The throughput the time estimate divides by, with the basis stated: the profile's
    measured rate when it ran on the device asked about and no --mfu is given, else
    positions per second computed from an MFU, the GPU's peak and the FLOPs per position.

    `device_share`: the measured step's share in forward/backward/optimizer, when the
    estimate adds the run's host time separately; a profile's MFU (model FLOPs over the
    whole step) is then divided by it, so host time is not counted twice."""
    pdev = profile.device if profile else None
    same_device = profile is not None and gpu is not None and find_gpu(pdev or "") == gpu
    if profile is not None and (gpu is None or same_device) and mfu is None:
        return _measured_throughput(profile)
    if gpu is None:
        raise ConfigError("give --gpu NAME (with an optional --mfu) or --from-profile PROFILE")
    if flops_per_token is None:
        raise ConfigError("a FLOPs-based estimate needs the model: give --model DIR or --params N")
    peak_precision = precision if precision in ("bf16", "fp16") else "tf32"
    peak, peak_src = gpu.peak_flops(peak_precision)
    if peak is None:
        raise ConfigError(
            f"{gpu.name} has no {peak_precision} peak in pitstop's table ({peak_src})"
        )
    used, why = _mfu_to_use(mfu, profile, precision, peak_precision, device_share)
    pps = used * peak / flops_per_token
    pauses = (
        "the device work only: the measured run's host time, its checkpoint and eval pauses "
        "included, is added as measured"
        if device_share
        else "no eval pauses included, checkpoints only with --save-steps"
    )
    basis = (
        f"computed: {pps:,.0f} positions/s = {why} × {peak / 1e12:.0f} TFLOP/s ({peak_src}) "
        f"÷ {flops_per_token:.3g} training FLOPs per position; {pauses}"
    )
    return Throughput(None, pps, used, 0.0, basis, gpu.name)


def _measured_throughput(profile: Measured) -> Throughput:
    """The measured run's trained tokens per second (its steady rate where its steps were
    kept), its start-up once, and the machine's load and MFU as measured."""
    pdev = profile.device
    startup = 0.0
    if profile.wall_seconds and profile.train_seconds:
        startup = max(0.0, float(profile.wall_seconds) - float(profile.train_seconds))
    steady = profile.steady
    if steady is not None:
        tps = steady.tokens_per_second
        startup += steady.extra_startup_seconds
        basis = (
            f"measured: {tps:,.0f} trained tokens/s = {steady.detail} in {profile.path} on {pdev}"
        )
    else:
        tps = profile.tokens_per_second
        basis = f"measured: {tps:,.0f} trained tokens/s in {profile.path} on {pdev}"
        tb = profile.time_breakdown
        pauses = sum(float(tb.get(k, 0)) for k in ("checkpoint", "eval"))
        if profile.train_seconds and pauses:
            basis += (
                f"; checkpoint/eval pauses ({pauses / float(profile.train_seconds):.1%} "
                "of train time) are inside that rate"
            )
    if startup:
        basis += f"; start-up {startup:.0f} s added once"
    load = describe_load(profile.machine)
    if load:  # a busy machine measures a slower rate than a quiet one would: say which
        basis += f"; machine {load} when measured"
    pm = float(profile.mfu) if profile.mfu else None
    if pm is not None and pm > 1:
        # Model FLOP/s cannot exceed the peak: the peak it was divided by (measured on a
        # CPU, once, and cached) came out low, e.g. on a busy machine.
        basis += (
            f"; the profile's MFU {pm:.0%} is above 100%, so the peak it divides by was "
            "measured low (a busy machine?): not shown; remeasure on a quiet machine"
        )
        pm = None
    return Throughput(tps, None, pm, startup, basis, pdev)


def _mfu_to_use(
    mfu: float | None,
    profile: Measured | None,
    precision: str,
    peak_precision: str,
    device_share: float | None,
) -> tuple[float, str]:
    """(MFU, why): the user's --mfu, else one a profile measured on a GPU (over the device
    phases when the host time is added apart), else DEFAULT_MFU, labelled an assumption."""
    pdev = profile.device if profile else None
    if mfu is not None:
        return mfu, f"MFU {mfu:.0%} (--mfu)"
    if profile is not None and profile.mfu and not _is_cpu(pdev or "cpu"):
        used = float(profile.mfu)
        if device_share and used / device_share <= 1:
            why = (
                f"MFU {used / device_share:.0%} over the device phases ({used:.0%} over the "
                f"whole step ÷ {device_share:.0%} of it on the device) measured on {pdev} "
                f"({profile.path}), assumed to carry over"
            )
            return used / device_share, why
        why = f"MFU {used:.0%} measured on {pdev} ({profile.path}), assumed to carry over"
        return used, why
    on = f"{precision} on the TF32 peak" if peak_precision == "tf32" else precision
    why = (
        f"MFU {DEFAULT_MFU:.0%} (an ASSUMPTION typical of tuned 16-bit fine-tuning, here {on}; "
        "measure with --from-profile)"
    )
    if profile is not None:
        why += f" (the profile ran on {pdev}, whose MFU does not carry over to a GPU)"
    return DEFAULT_MFU, why


def options_table(
    *,
    seconds_1: float,
    startup: float,
    gpu_counts: list[int],
    scaling: float,
    price: float | None,
    memory: MemoryEstimate | None,
    usable: int | None,
) -> list[OptionRow]:
    """One row per GPU count: strategy, memory per GPU, time, cost, and the verdict vs 1 GPU."""
    rows = []
    work = seconds_1 - startup
    base_cost = None
    for n in gpu_counts:
        speedup = n * scaling ** math.log2(n) if n > 1 else 1.0
        secs = startup + work / speedup
        strategy, per_gpu = "single", memory.peak if memory else None
        if n > 1:
            strategy = "DDP"
            if memory is not None:
                per_gpu = memory.peak + memory.gradients  # DDP's gradient bucket buffer
                if usable is not None and per_gpu > usable:
                    strategy, per_gpu = "FSDP", sharded(memory, n)
        fits = per_gpu <= usable if (usable is not None and per_gpu is not None) else None
        cost = secs / 3600 * n * price if price is not None else None
        if n == 1:
            base_cost, base_secs = cost, secs
        if n > 1:
            faster = base_secs / secs
            if cost is not None and base_cost:
                extra = cost / base_cost - 1
                verdict = f"{faster:.2f}x sooner for {extra:+.0%} cost"
                if abs(extra) < 0.02:
                    verdict = f"{faster:.2f}x sooner at about the same cost"
            else:
                verdict = f"{faster:.2f}x sooner"
            if fits is False:
                verdict = "does not fit: " + verdict
        else:
            verdict = "does not fit" if fits is False else "baseline"
        row = OptionRow(
            gpus=n,
            strategy=strategy,
            memory_per_gpu_bytes=per_gpu,
            fits=fits,
            speedup=round(speedup, 3),
            train_seconds=round(secs, 1),
            hours=round(secs / 3600, 3),
            cost=round(cost, 4) if cost is not None else None,
            verdict=verdict,
        )
        rows.append(row)
    return rows


def estimate(shape: ModelShape, req: EstimateRequest) -> Estimate:
    """Memory, time and cost of a planned run, and the multi-GPU options table: the plan
    and its memory, the throughput, the optimizer steps, the work (measured, or computed
    with a measured run's host time kept), checkpoints, start-up, the price, the options.
    `notes` gathers each step's assumptions in that order.

    `req.step`: the measured run's optimizer step (default: `measured_step(req.profile)`);
    the micro-batch rows, row length and accumulation left None are its own, and its tokens
    per step set the step count (scaled by what a flag changed)."""
    tokens, epochs, profile = req.tokens, req.epochs, req.profile
    step = req.step if req.step is not None else measured_step(profile)
    gpu = req.gpu if req.gpu is not None or profile is None else find_gpu(profile.device)
    notes: list[str] = [req.kept_from_profile] if req.kept_from_profile else []
    plan = _plan(req, step, gpu)
    cost, mbs = _priced_plan(shape, plan, gpu, req.headroom, notes)
    host = host_time(profile) if profile is not None else None
    tp = throughput(
        profile=profile,
        gpu=gpu,
        mfu=req.mfu,
        precision=req.precision,
        flops_per_token=cost.hardware_flops_per_token,
        device_share=host.device_share if host else None,
    )
    steps, steps_basis = optimizer_steps(
        tokens,
        epochs,
        step=step,
        tokens_per_step=req.tokens_per_step,
        micro_positions=plan.micro_batch_size * plan.seq_len,
        planned=(plan.micro_batch_size, plan.seq_len, plan.grad_accum),
    )
    split: HostAndDevice | None = None
    if tp.trained_tokens_per_second:  # the measured rate holds the host time already
        work = _measured_work(req, plan, cost, tp.trained_tokens_per_second, notes)
    else:
        # With the measured step's own micro-batches, their count is the steps' count.
        own_steps = step is not None and not req.tokens_per_step
        work = _computed_work(req, plan, tp, steps if own_steps else None, notes)
        split = _keep_host_time(host, req, work, steps, gpu, tp, notes)
        if split is not None:
            work += split["host_seconds"]
    # The run's own save pauses are inside a measured rate or a kept host time.
    kept_pauses = bool(tp.trained_tokens_per_second) or split is not None
    ckpt = _checkpoints(shape, plan, req, steps, kept_pauses)
    if ckpt is not None:
        work += ckpt["added_seconds"]
        notes.append(ckpt["basis"])
    seconds = tp.startup_seconds + work
    price, price_basis = _price(req.price, gpu)
    options = _options(req, gpu, seconds, tp.startup_seconds, price, cost, notes)
    usable = cost.usable_bytes
    alternatives: list[MemoryOption] = []
    if usable is not None and cost.memory.peak > usable:  # what would fit, cheapest first
        alternatives = memory_options(shape, plan, usable=usable)
    return Estimate(
        memory_options=alternatives,
        memory=cost.memory,
        max_micro_batch=mbs,
        gpu=gpu,
        usable_bytes=usable,
        train_seconds=seconds,
        time_basis=tp.basis,
        tokens=tokens,
        epochs=epochs,
        price=price,
        price_basis=price_basis,
        options=options,
        flops_per_token=cost.hardware_flops_per_token,
        throughput=tp,
        assumptions=notes,
        lora=plan.lora_r is not None,
        gradient_checkpointing=plan.gradient_checkpointing,
        optimizer_steps=steps,
        steps_basis=steps_basis,
        checkpoints=ckpt,
        split=split,
    )


def _plan(req: EstimateRequest, step: StepShape | None, gpu: Gpu | None) -> Plan:
    """The plan to price: the request's settings, with the row length, micro-batch rows and
    accumulation it leaves None taken from the measured step, else the data's row length
    (1024 without one), 1 row, no accumulation. A CPU profile's optimizer is the one it
    recorded, else foreach (pitstop's CPU choice before fused AdamW)."""
    seq_len = req.seq_len or (step.seq_len if step else None) or req.tokens.max_seq_len or 1024
    profile = req.profile
    return Plan(
        micro_batch_size=req.micro_batch_size or (step.rows if step else None) or 1,
        seq_len=seq_len,
        precision=req.precision,
        attention=req.attention,
        gradient_checkpointing=req.gradient_checkpointing,
        lora_r=req.lora_r,
        load_in_4bit=req.load_in_4bit,
        fused_optimizer=_fused_optimizer(profile, gpu),
        optimizer=req.optimizer,
        grad_accum=req.grad_accum or (step.accumulation if step else None) or 1,
    )


def _priced_plan(
    shape: ModelShape, plan: Plan, gpu: Gpu | None, headroom: float, notes: list[str]
) -> tuple[PlanCost, int | None]:
    """The plan's memory and FLOPs (`plan_cost`), and on a GPU the largest micro-batch
    that fits; notes say what "fits" means and what recomputation adds."""
    cost = plan_cost(shape, plan, gpu.memory_bytes if gpu else None, headroom=headroom)
    mbs = None
    if gpu is not None and cost.usable_bytes is not None:
        notes.append(
            f"fits = peak ≤ ({gpu.name} {gpu.memory_bytes / GiB:.1f} GiB − "
            f"{CUDA_CONTEXT_BYTES / GiB:g} GiB CUDA context) × {1 - headroom:.0%} (headroom for "
            "allocator fragmentation)"
        )
        mbs = max_micro_batch(shape, cost.usable_bytes, plan)
    recompute = cost.recompute_per_token
    if recompute:
        notes.append(
            f"gradient checkpointing recomputes the forward pass during backward: "
            f"+{recompute:.3g} FLOPs per position (2·N + 4·L·d·T), "
            f"{recompute / cost.flops_per_token:.0%} more "
            "compute per step, included in the time (MFU counts model FLOPs only)"
        )
    return cost, mbs


def _measured_work(
    req: EstimateRequest, plan: Plan, cost: PlanCost, tokens_per_second: float, notes: list[str]
) -> float:
    """Seconds of work at the measured rate: the planned trained tokens over it, scaled by
    the FLOPs ratio when the plan and the profile differ in gradient checkpointing."""
    work = req.tokens.trained_tokens * req.epochs / tokens_per_second
    ran_ck = _profile_checkpointing(req.profile)
    if ran_ck != plan.gradient_checkpointing:
        # The profile ran with the other setting: scale its time by the FLOPs ratio.
        fpt, rc = cost.flops_per_token, cost.flops.recompute_per_token(plan.seq_len)
        factor = (fpt + rc) / fpt if plan.gradient_checkpointing else fpt / (fpt + rc)
        work *= factor
        notes.append(
            f"the profile ran {'with' if ran_ck else 'without'} gradient checkpointing: its "
            f"time is scaled by {factor:.2f} (FLOPs per position with/without recomputation)"
        )
    return work


def _computed_work(
    req: EstimateRequest,
    plan: Plan,
    tp: Throughput,
    own_steps: int | None,
    notes: list[str],
) -> float:
    """Seconds of device work at a computed rate: the positions (tokens ÷ packing
    efficiency) over positions per second, at least STEP_FLOOR_SECONDS per micro-step
    (`own_steps`: the measured step's count, whose micro-batches are its own)."""
    tokens, epochs = req.tokens, req.epochs
    assert tp.positions_per_second is not None  # `throughput` computed it
    positions = tokens.tokens / (tokens.packing_efficiency or 1.0)
    work = positions * epochs / tp.positions_per_second
    if tokens.packing_efficiency is None:
        notes.append("positions = tokens: assumes packed rows with no padding")
    micro_steps = positions * epochs / (plan.micro_batch_size * plan.seq_len)
    if own_steps is not None:
        micro_steps = own_steps * plan.grad_accum
    floor = micro_steps * STEP_FLOOR_SECONDS
    if floor > work:
        notes.append(
            f"time floor: {micro_steps:,.0f} micro-steps × {STEP_FLOOR_SECONDS * 1000:g} ms "
            f"per-step overhead (kernel launches, optimizer; an ASSUMED floor, not measured) "
            f"= {floor:.1f} s exceeds the FLOPs time {work:.2g} s: this model is too small "
            "to keep the GPU busy; a larger --micro-batch-size helps"
        )
        work = floor
    return work


def _keep_host_time(
    host: HostTime | None,
    req: EstimateRequest,
    device_seconds: float,
    steps: int,
    gpu: Gpu | None,
    tp: Throughput,
    notes: list[str],
) -> HostAndDevice | None:
    """A measured run moved to another device: its host time carried over beside the
    device time, and its start-up (host work too) added once, as measured. None without
    a measured run, or (said in `notes`) when its record does not separate host time."""
    profile = req.profile
    if profile is None:
        return None
    if host is None:
        notes.append(
            f"{profile.path} records no time per phase (forward, backward, optimizer "
            "apart from the rest): its host time (data loading, logging, ...) is not "
            "known, so none is added; the time is the device work alone, a lower bound"
        )
        return None
    trained = req.tokens.trained_tokens * req.epochs
    split = _host_and_device(host, trained, device_seconds, steps, gpu)
    # Start-up (process start, model and data loading, worker spawn) is host work too.
    wall, train = profile.wall_seconds, profile.train_seconds
    if wall and train:
        tp.startup_seconds = max(0.0, float(wall) - float(train))
    if tp.startup_seconds:
        tp.basis += f"; start-up {tp.startup_seconds:.0f} s (as measured) added once"
    return split


def _checkpoints(
    shape: ModelShape, plan: Plan, req: EstimateRequest, steps: int, kept_pauses: bool
) -> CheckpointOverhead | None:
    """The time the run's saves add (`checkpoint_overhead`); none when the measured
    rate or the kept host time already holds the run's own save pauses (`kept_pauses`)."""
    return checkpoint_overhead(
        shape,
        plan,
        steps=steps,
        save_steps=req.save_steps,
        disk_write_gbps=req.disk_write_gbps,
        measured=_measured_checkpoint_seconds(req.profile) if kept_pauses else 0.0,
    )


def _price(price: float | None, gpu: Gpu | None) -> tuple[float | None, str]:
    """The price per GPU-hour and its basis: the user's, else the GPU's example price."""
    if price is not None:
        return price, f"{price} per GPU-hour (yours)"
    if gpu is not None and gpu.example_price_per_hour is not None:
        price = gpu.example_price_per_hour
        return price, f"EXAMPLE price {price} USD per {gpu.name}-hour: {PRICES_SOURCE}"
    return None, "no price: give --price-per-gpu-hour"


def _options(
    req: EstimateRequest,
    gpu: Gpu | None,
    seconds: float,
    startup: float,
    price: float | None,
    cost: PlanCost,
    notes: list[str],
) -> list[OptionRow]:
    """The options table for the requested GPU counts (one for a CPU profile)."""
    counts = list(req.gpu_counts or [1, 2, 4, 8])
    if gpu is None:
        counts = [1]  # a CPU profile: no multi-GPU scaling to speak of
    notes.append(
        f"multi-GPU: each doubling keeps {req.scaling:.0%} of linear speed-up (assumed; "
        "--scaling-efficiency); DDP adds a gradient-sized bucket buffer per GPU"
    )
    return options_table(
        seconds_1=seconds,
        startup=startup,
        gpu_counts=counts,
        scaling=req.scaling,
        price=price,
        memory=cost.memory,
        usable=cost.usable_bytes,
    )


def optimizer_steps(
    tokens: DataTokens,
    epochs: float,
    *,
    step: StepShape | None,
    tokens_per_step: int | None,
    micro_positions: int,
    planned: tuple[int, int, int] | None = None,
) -> tuple[int, str]:
    """How many optimizer steps the run takes, and what the step size rests on.

    A measured step (`step`) is kept: its trained tokens per step divide the planned
    trained tokens, whatever device the estimate is for. `planned` (micro-batch rows, row
    length, accumulation) scales it where a flag changed one of them."""
    if tokens_per_step:
        per, basis = float(tokens_per_step), f"--tokens-per-step {tokens_per_step:,} positions"
        work = tokens.tokens * epochs / (tokens.packing_efficiency or 1.0)
    elif step is not None:
        per, work = step.trained_tokens, tokens.trained_tokens * epochs
        basis = f"{step.describe()}, as in the measured run"
        changed = []
        if planned is not None:
            was = (step.rows, step.seq_len, step.accumulation)
            names = ("micro-batch rows", "row length", "accumulation")
            for name, new, old in zip(names, planned, was):
                if old and new and new != old:
                    per *= new / old
                    changed.append(f"{name} {old:,} → {new:,}")
        if changed:
            basis = (
                f"{per:,.0f} trained tokens per step: the measured run's "
                f"{step.describe()} scaled by your {', '.join(changed)}"
            )
    else:
        per = float(micro_positions)
        work = tokens.tokens * epochs / (tokens.packing_efficiency or 1.0)
        basis = (
            f"one micro-batch of {micro_positions:,} positions per step (no gradient "
            "accumulation); give --tokens-per-step T for yours"
        )
    return max(1, math.ceil(work / per)), basis


def _host_and_device(
    host: HostTime, trained_tokens: float, device_seconds: float, steps: int, gpu: Gpu | None
) -> HostAndDevice:
    """The measured host time carried over, beside the device time scaled to `gpu`."""
    host_s = host.seconds_per_token * trained_tokens
    per_step = {k: v * trained_tokens / steps for k, v in host.per_token.items()}
    where = gpu.name if gpu is not None else "the target device"
    kept = ", ".join(f"{k} {v:.3g} s" for k, v in sorted(per_step.items(), key=lambda kv: -kv[1]))
    total = host_s + device_seconds
    basis = (
        f"host time kept as measured: {host_s / steps:.3g} s per step ({kept}; "
        f"{host.share:.1%} of the measured step) × {steps:,} steps = {_dur(host_s)}; "
        f"device time (forward, backward, optimizer) scaled to {where}: "
        f"{device_seconds / steps:.3g} s per step = {_dur(device_seconds)}"
    )
    if total > 0:
        basis += f"; host {host_s / total:.0%} of the estimated time"
    return HostAndDevice(
        host_seconds=round(host_s, 3),
        device_seconds=round(device_seconds, 3),
        host_seconds_per_step=host_s / steps,
        device_seconds_per_step=device_seconds / steps,
        host_share_measured=round(host.share, 4),
        host_phases_seconds_per_step={k: round(v, 6) for k, v in per_step.items()},
        basis=basis,
    )


def _measured_tokens_per_step(profile: Measured | None) -> float | None:
    v = profile.tokens_per_step if profile else None
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


def _measured_checkpoint_seconds(profile: Measured | None) -> float:
    """Checkpoint seconds the measured run paid (then they are inside its measured rate)."""
    if not profile:
        return 0.0
    return float(profile.time_breakdown.get("checkpoint") or 0.0)


def checkpoint_overhead(
    shape: ModelShape,
    plan: Plan,
    *,
    steps: int,
    save_steps: int | None,
    disk_write_gbps: float | None,
    measured: float = 0.0,
) -> CheckpointOverhead | None:
    """save_steps × checkpoint bytes ÷ write bandwidth: the time the run's saves add.

    A checkpoint holds the trained weights and the optimizer state (so `--resume` is
    exact): `cost_model.checkpoint_bytes`. The bandwidth is the user's --disk-write-gbps,
    else `ASSUMED_WRITE_BYTES_PER_SECOND`, stated as an assumption. pitstop's own trainer
    writes in a background thread after a host copy, so for it this is an upper bound; the
    Hugging Face Trainer saves synchronously. None without --save-steps.
    """
    if not save_steps:
        return None
    n = steps // save_steps
    size = checkpoint_bytes(shape, plan)
    bw = disk_write_gbps * 1e9 if disk_write_gbps else ASSUMED_WRITE_BYTES_PER_SECOND
    each = size / bw
    where = (
        f"{disk_write_gbps:g} GB/s (yours, --disk-write-gbps)"
        if disk_write_gbps
        else f"{bw / 1e9:g} GB/s (ASSUMED: a network volume or SATA-class disk; "
        "--disk-write-gbps sets yours)"
    )
    added = n * each
    basis = (
        f"checkpoints: {steps:,} optimizer steps ÷ --save-steps {save_steps} = {n:,} saves × "
        f"{size / GiB:.2f} GiB (weights + optimizer state) ÷ {where} = {n:,} × {each:.1f} s = "
        f"{added / 60:.1f} min"
    )
    if measured > 0:
        basis += "; not added: the measured rate already holds the run's own save pauses"
        added = 0.0
    return CheckpointOverhead(
        saves=n,
        bytes_per_save=size,
        seconds_per_save=round(each, 3),
        write_bytes_per_second=bw,
        bandwidth_assumed=not disk_write_gbps,
        added_seconds=round(added, 3),
        basis=basis,
    )


@dataclass(frozen=True)
class _MemoryChange:
    """One memory option: its flags, the plan settings it changes, and what it costs."""

    flags: str
    change: dict[str, object]
    what: str


# The memory options of a plan that does not fit, cheapest first. The order is the cost to
# the run: the same math first, then more compute, then a different method (an adapter
# instead of the model).
_CK: dict[str, object] = {"gradient_checkpointing": True}
_MEMORY_OPTIONS: tuple[_MemoryChange, ...] = (
    _MemoryChange(
        "--optimizer adamw_8bit",
        {"optimizer": "adamw_8bit"},
        "the same AdamW update with 8-bit moments (block-wise quantised)",
    ),
    _MemoryChange(
        "--gradient-checkpointing",
        _CK,
        "the same math; the forward pass is computed again in backward",
    ),
    _MemoryChange(
        "--gradient-checkpointing --optimizer adamw_8bit",
        {**_CK, "optimizer": "adamw_8bit"},
        "both of the above",
    ),
    _MemoryChange("--lora-r 16", {"lora_r": 16}, "a LoRA adapter instead of the full model"),
    _MemoryChange(
        "--lora-r 16 --gradient-checkpointing",
        {"lora_r": 16, **_CK},
        "a LoRA adapter, activations recomputed",
    ),
    _MemoryChange(
        "--lora-r 16 --load-in-4bit --gradient-checkpointing",
        {"lora_r": 16, "load_in_4bit": True, **_CK},
        "QLoRA: a LoRA adapter on frozen 4-bit weights, activations recomputed",
    ),
)


def memory_options(shape: ModelShape, plan: Plan, *, usable: int) -> list[MemoryOption]:
    """Each memory option not already in `plan`: its peak and whether it fits `usable`
    bytes, the ones that fit first, cheapest first."""
    rows = []
    for opt in _MEMORY_OPTIONS:
        if all(getattr(plan, k) == v for k, v in opt.change.items()):
            continue  # already the plan
        if plan.lora_r is not None and "lora_r" in opt.change:
            continue  # the plan's own rank stands
        # With the plan's own accumulation: the gradients kept across micro-batches count
        # in each option's peak (priced without them, an option could say it fits when the
        # run it describes would not).
        option = replace(plan, **opt.change)  # type: ignore[arg-type]
        peak = estimate_memory(shape, option).peak
        rows.append(
            MemoryOption(flags=opt.flags, changes=opt.what, peak_bytes=peak, fits=peak <= usable)
        )
    return sorted(rows, key=lambda r: not r["fits"])  # stable: cheapest first within each


def recompute_per_token(fm: FlopsModel, seq_len: int) -> float:
    """FLOPs per position that full activation recomputation adds (the cost model's)."""
    return fm.recompute_per_token(seq_len)


def _profile_checkpointing(profile: Measured | None) -> bool:
    """Whether the measured run recomputed activations (pitstop's or TrainingArguments' name)."""
    cfg = profile.config if profile is not None else {}
    return bool(cfg.get("gradient_checkpointing") or cfg.get("activation_checkpointing"))


def flops_label(lora: bool, gradient_checkpointing: bool) -> str:
    """The formula behind the printed FLOPs per position (pitstop/measure/cost_model.py)."""
    dense = "6·N_trainable + 4·N_frozen" if lora else "6N"
    ck = " + 2N + 4·L·d·T recomputed" if gradient_checkpointing else ""
    return f"{dense} + 12·L·d·T{ck}"


def _gib(b: float | None) -> str:
    return "-" if b is None else f"{b / GiB:.2f} GiB"


def _usd(c: float) -> str:
    return f"{c:.2f}" if c >= 0.01 or c == 0 else f"{c:.1g}"


def _dur(s: float) -> str:
    if s < 10:
        return f"{s:.1f} s"
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def format_estimate(est: Estimate) -> str:
    """The human-readable report printed by `pitstop estimate`."""
    lines = []
    m = est.memory
    if m is not None:
        lines.append(
            f"Memory (micro-batch {m.micro_batch_size} × {m.seq_len} tokens, {m.precision}, "
            f"{m.trainable_params:,} of {m.total_params:,} parameters train)"
        )
        for k, v in m.parts().items():
            if v:
                lines.append(f"  {k:<24} {_gib(v):>12}")
        lines.append(f"  {'peak':<24} {_gib(m.peak):>12}")
        if est.gpu is not None and est.usable_bytes is not None:
            ok = "fits" if m.peak <= est.usable_bytes else "DOES NOT FIT"
            lines.append(
                f"  on {est.gpu.name}: {ok} (usable {_gib(est.usable_bytes)}); largest micro-batch "
                f"that fits: {est.max_micro_batch}"
            )
        for a in m.assumptions:
            lines.append(f"  - {a}")
    t = est.to_dict()["time"]
    lines.append("")
    steps = f", {est.optimizer_steps:,} optimizer steps" if est.optimizer_steps else ""
    lines.append(f"Time: {_dur(est.train_seconds)} for {est.epochs:g} epoch(s){steps}")
    if est.steps_basis:
        lines.append(f"  - optimizer steps: {est.steps_basis}")
    lines.append(f"  - data: {est.tokens.basis}")
    if est.split is not None:
        lines.append(f"  - {est.split['basis']}")
    lines.append(f"  - throughput: {est.time_basis}")
    if t["flops_per_token"]:
        label = flops_label(est.lora, est.gradient_checkpointing)
        lines.append(f"  - training FLOPs per position: {t['flops_per_token']:.3g} ({label})")
    lines.append("")
    c = est.to_dict()["cost"]
    if c["total"] is not None:
        lines.append(f"Cost: {_usd(c['total'])} USD on one GPU ({c['price_basis']})")
    else:
        lines.append(f"Cost: - ({c['price_basis']})")
    lines.append("")
    lines.append("Options")
    if est.gpu is not None and est.usable_bytes is not None:
        lines.append(
            f"  (fits: memory per GPU ≤ {_gib(est.usable_bytes)} usable of each "
            f"{est.gpu.name}'s {_gib(est.gpu.memory_bytes)})"
        )
    lines.append(
        f"  {'GPUs':>4}  {'strategy':<8} {'mem/GPU':>11} {'fits':>5} {'time':>9} {'cost':>9}  verdict"
    )
    for r in est.options:
        fits = "-" if r["fits"] is None else ("yes" if r["fits"] else "no")
        cost = "-" if r["cost"] is None else _usd(r["cost"])
        lines.append(
            f"  {r['gpus']:>4}  {r['strategy']:<8} {_gib(r['memory_per_gpu_bytes']):>11} "
            f"{fits:>5} {_dur(r['train_seconds']):>9} {cost:>9}  {r['verdict']}"
        )
    for a in est.assumptions:
        lines.append(f"  - {a}")
    if est.memory_options:
        gpu_name = est.gpu.name if est.gpu else "the GPU"
        sharded_fit = [r["gpus"] for r in est.options if r["gpus"] > 1 and r["fits"]]
        if sharded_fit:
            shard = f"shard across {min(sharded_fit)} or more GPUs (the options above), or"
        else:
            shard = "no GPU count above fits either; try"
        lines.append("")
        lines.append(f"one {gpu_name} is not enough: {shard} these memory options, cheapest first:")
        for r in est.memory_options:
            fits = "fits" if r["fits"] else "does not fit"
            lines.append(
                f"  {r['flags']:<52} peak {_gib(r['peak_bytes']):>11}  {fits:<12} {r['changes']}"
            )
    return "\n".join(lines)
