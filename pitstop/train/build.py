"""`build_run(cfg)`: everything a training run needs, assembled before the loop starts.

The order matters and is kept from the trainer that used to do this itself: the seed
first; choices that need only the machine (nothing written yet, so a ConfigError
leaves no trace); the model (its directory checked before the tokenizer reads its
config); the data after the model (`batching: auto` times each strategy on it); FLOPs
and the device peak; the distributed wrapper after `auto`'s timing (it times the plain
model, no collectives) and before the optimizer (FSDP2 replaces the parameters by
sharded DTensors); then the optimizer, the loss scaler and the checkpoint writer.

`Trainer` receives the `Run` and only runs the loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import torch

from pitstop import probe
from pitstop.batching.loader import Loader
from pitstop.batching.payoff import seconds_per_position
from pitstop.batching.resolve import BatchRequest
from pitstop.batching.settings import BatchSettings
from pitstop.catalog.layouts import Layout
from pitstop.core import log, run_record, versions
from pitstop.core.cache_layout import cache_root
from pitstop.core.config import RunConfig, parse_betas
from pitstop.core.errors import ConfigError
from pitstop.core.faults import NO_FAULTS, Faults, from_env
from pitstop.core.positions import check_positions
from pitstop.measure import cost_model  # the one cost model: FLOPs, optimizer-state bytes
from pitstop.measure.machine import CpuSnapshot, cpu_snapshot
from pitstop.measure.peak import device_peak
from pitstop.probe import Choice, DeviceInfo
from pitstop.train import (
    attention_check,
    attention_rows,
    checkpoint,
    compile_record,
    data,
    distributed,
    memory_plan,
    model_io,
    optim,
    packcheck,
    precision_record,
    startup,
)
from pitstop.train.compile import compile_module
from pitstop.train.evaluate import EvalSet
from pitstop.train.forward import TimedMicroBatch, autocast_for, loss_choice
from pitstop.train.optim import build_optimizer
from pitstop.train.schedule import default_warmup


@dataclass
class Run:
    """What `build_run` assembled; the Trainer's inputs (see the module docstring)."""

    cfg: RunConfig
    out: Path
    t_process: float  # when the process started (wall_seconds counts from it)
    cpu_start: CpuSnapshot | None  # the CPU times other processes' share is measured from
    env: distributed.DistEnv
    dev: DeviceInfo
    device: torch.device
    choices: dict[str, Choice]  # each decision and why, for the banner and summary.json
    precision: str
    autocast_dtype: torch.dtype | None
    tokenizer: Any
    model: Any
    wrapped: Any  # the model inside DDP/FSDP (or the model itself)
    forward_model: Any  # what the training forward calls: wrapped, or its compiled forward
    compiled: bool
    # A compiling run that measures compile's cost and gain on its steps (some eager).
    compile_timing: compile_record.CompileTiming | None
    loader: Loader
    geometry: data.Geometry
    eval_set: EvalSet | None
    steps_per_epoch: int
    total_steps: int
    warmup: int
    flops: cost_model.FlopsModel
    flops_per_token: float
    peak_flops: float | None
    peak_source: str
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    sync_free_skip: bool
    writer: checkpoint.CheckpointWriter
    data_key: str | None  # the token store's content key: a resume's data identity
    faults: Faults = NO_FAULTS  # a test's fault points (pitstop/core/faults.py); none by default

    @property
    def fsdp(self) -> bool:
        return self.env.distributed and self.cfg.strategy == "fsdp"


@dataclass(frozen=True)
class _Machine:
    """Where the run executes and the kernels it uses (decided before anything loads)."""

    env: distributed.DistEnv
    dev: DeviceInfo
    device: torch.device
    precision: str
    tf32: Choice
    attention: Choice  # asked for; the model load may change it (train/model_io.py)
    strategy: str  # cfg.strategy (ddp or fsdp)

    @property
    def fsdp(self) -> bool:
        return self.env.distributed and self.strategy == "fsdp"


def build_run(
    cfg: RunConfig,
    *,
    device: DeviceInfo | None = None,
    loader: Loader | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> Run:
    """Assemble a run of `cfg`. Writes nothing to the output directory.

    `device` overrides the probe (tests pretend machines with it); `loader` replaces the
    batching loader (any object honouring the `pitstop.batching.loader.Loader` protocol);
    `rank` / `world_size` place the run in a process group the caller made (else
    torchrun's, if any). Its steps follow the order the module docstring explains.
    """
    t_process, cpu_start = startup.process_start(), cpu_snapshot()
    faults = from_env()  # the one read of the test fault variables (pitstop/core/faults.py)
    faults.reached("startup")
    out = startup.check_output_dir(cfg)
    startup.seed_everything(cfg.seed)
    startup.quiet_transformers()
    choices: dict[str, Choice] = {}  # each decision and why, in the banner's order
    m = place_run(cfg, device, rank, world_size, choices, out)
    tokenizer, model, autocast_dtype, packed = load_model(cfg, m, choices)
    loader, geometry, eval_set, data_key = build_data(
        cfg, out, m, model, autocast_dtype, choices, loader
    )
    choices["packed_attention"] = attention_check.packed_attention_choice(
        packed, str(choices["batching"].value), m.env.rank
    )
    steps_per_epoch = int(loader.steps_per_epoch)
    total_steps = int(loader.total_steps)
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else default_warmup(total_steps)
    flops, peak_flops, peak_source, wrapped, forward_model, compile_timing = plan_compute(
        cfg, m, model, geometry, total_steps, choices, faults, loader.settings
    )
    run_s = estimated_run_s(total_steps, geometry, flops, peak_flops)
    choices["attention_rows"] = decide_attention_rows(
        cfg, m, model, loader, choices, out, autocast_dtype, run_s
    )
    geometry.measured = _with_run_choices(geometry.measured, choices, m.dev)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scaler, sync_free_skip = build_optimizer_parts(cfg, m, model, choices)
    writer = build_writer(cfg, out, m, model, tokenizer, params, eval_set, faults, choices)
    return Run(
        cfg=cfg,
        out=out,
        t_process=t_process,
        cpu_start=cpu_start,
        env=m.env,
        dev=m.dev,
        device=m.device,
        choices=choices,
        precision=m.precision,
        autocast_dtype=autocast_dtype,
        tokenizer=tokenizer,
        model=model,
        wrapped=wrapped,
        forward_model=forward_model,
        compiled=bool(choices["compile"].value),
        compile_timing=compile_timing,
        loader=loader,
        geometry=geometry,
        eval_set=eval_set,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        warmup=warmup,
        flops=flops,
        flops_per_token=flops.per_token(geometry.flops_seq_len),
        peak_flops=peak_flops,
        peak_source=peak_source,
        params=params,
        optimizer=optimizer,
        scaler=scaler,
        sync_free_skip=sync_free_skip,
        writer=writer,
        data_key=data_key,
        faults=faults,
    )


def place_run(
    cfg: RunConfig,
    device: DeviceInfo | None,
    rank: int | None,
    world_size: int | None,
    choices: dict[str, Choice],
    out: Path | None = None,
) -> _Machine:
    """Choices that need only the machine: device, process group, precision, TF32,
    attention, optimizer kind. May raise ConfigError (nothing is written yet)."""
    if device is None:
        device, dev_choice = probe.detect_device(cfg.device)
    else:
        dev_choice = Choice(device.torch_device, "given by the caller (probe overridden)")
    if rank is None and world_size is None:
        # Launched by torchrun: join its process group (and take GPU LOCAL_RANK).
        env, device = distributed.init(device)
    else:  # the caller places this run (a test, or a custom launcher with its own group)
        w = world_size or 1
        env = distributed.DistEnv(rank or 0, w, rank or 0, "gloo" if w > 1 else None)
    problems = distributed.check_strategy(cfg, env)
    if problems:
        raise ConfigError(problems, header="invalid configuration for several processes:")
    choices["device"] = dev_choice
    host = probe.choose_host_memory(cfg.keep_freed_memory, device)
    choices["host_memory"] = probe.apply_host_memory(host)
    # Several CPU processes would each time the CPU alone and might disagree: they keep
    # the unmeasured answer (fp32) unless bf16 is asked for.
    # A resumed run keeps the precision its first life measured (choices.json), so a
    # cleared cache or a busier machine cannot change the math halfway.
    prec = precision_record.kept_precision(cfg, out, device)
    if prec is None:
        measured = None if env.distributed else precision_record.cpu_precision_speed(cfg, device)
        prec = probe.choose_precision(cfg.precision, device, measured)
    choices["precision"] = prec
    precision = prec.value
    tf32 = probe.choose_tf32(device, precision)
    choices["tf32"] = tf32
    probe.apply_backend_flags(device, tf32)
    attention = probe.choose_attention(cfg.attention, device, precision)
    # Known-bad torch/transformers pairs crash or let packed documents attend to each other.
    versions.check_versions(attention=attention.value, model_type=versions.model_type_of(cfg.model))
    choices["optimizer"] = optim.choose(cfg, device)
    return _Machine(
        env, device, torch.device(device.torch_device), precision, tf32, attention, cfg.strategy
    )


def load_model(
    cfg: RunConfig, m: _Machine, choices: dict[str, Choice]
) -> tuple[Any, Any, torch.dtype | None, packcheck.PackCheck]:
    """(tokenizer, model, autocast dtype, the packed-attention self-check). The directory
    is checked before the tokenizer reads its config; the attention kernel is final once
    the model is loaded and its first forward kept packed documents apart."""
    env, device, precision = m.env, m.dev, m.precision
    model_io.check_model_dir(Path(cfg.model), cfg.trust_remote_code)
    note = check_positions(cfg.model, cfg.max_seq_len)
    if note and env.rank == 0:
        log.warning(f"pitstop: warning: {note}")
    t_load = time.perf_counter()
    if env.rank == 0:  # the first silent second before the banner is the model load
        log.info(f"pitstop: loading the model from {cfg.model} ...")
    tokenizer = model_io.load_tokenizer(cfg)
    model, attention, lora = model_io.load_model(cfg, device, precision, m.attention)
    if env.rank == 0:
        log.info(f"pitstop: model loaded in {time.perf_counter() - t_load:.1f} s")
    autocast_dtype = autocast_for(precision)
    # The first forward: packed documents must stay apart with this kernel, on this device
    # and these versions (train/packcheck.py); a kernel that cannot even run falls back.
    packed, fallback = attention_check.packed_attention_check(
        model, m.device, attention.value, autocast_dtype, precision
    )
    attention = fallback or attention
    choices["attention"] = attention
    choices["gradient_checkpointing"] = Choice(
        cfg.gradient_checkpointing,
        "asked for: activations recomputed in backward (~1/3 more compute, far less memory)"
        if cfg.gradient_checkpointing
        else "off: activations kept (fastest; turn on with --gradient-checkpointing if memory is short)",
    )
    if lora is not None:
        choices["lora"] = lora
    return tokenizer, model, autocast_dtype, packed


def build_data(
    cfg: RunConfig,
    out: Path,
    m: _Machine,
    model: Any,
    autocast_dtype: torch.dtype | None,
    choices: dict[str, Choice],
    loader: Loader | None,
) -> tuple[Loader, data.Geometry, EvalSet | None, str | None]:
    """(loader, geometry, eval set, the store's content key). After the model: `batching:
    auto` times each strategy on it, and a GPU run sizes its micro-batch with it."""
    env, device, tdev, fsdp = m.env, m.dev, m.device, m.fsdp
    attention = choices["attention"]

    timing_micro_batch = TimedMicroBatch(model, tdev, attention.value, autocast_dtype)
    eval_set: EvalSet | None = None
    data_key: str | None = None
    if loader is None:
        store = data.open_training_store(cfg)
        data_key = store.manifest.get("key")
        held = data.eval_data(cfg, store)
        resume_strategy = data.saved_strategy(out) if cfg.resume else None
        sizer = None
        if tdev.type == "cuda" and not fsdp:
            optimizer = choices["optimizer"]
            sizer = memory_plan.cuda_sizer(
                model,
                tdev,
                attention.value,
                autocast_dtype,
                optimizer,
                ddp=env.distributed,
                cfg=cfg,
                precision=m.precision,
            )
        request = BatchRequest(
            cfg,
            store,
            rank=env.rank,
            world_size=env.world_size,
            run_micro_batch=timing_micro_batch,
            resume_strategy=resume_strategy,
            indices=held.train_indices if held else None,
            lockstep=fsdp,
            device_name=device.name,
            device_type=tdev.type,
            out=out,
            cache_dir=cfg.cache_dir,
            sizer=sizer,
            seconds_per_position=_seconds_per_position(cfg, m, model),
        )
        loader, geometry = data.build_loader(request)
        if held is not None:
            eval_set = EvalSet(
                held.store,
                loader.settings,
                indices=held.indices,
                rank=env.rank,
                seed=cfg.seed,
                lockstep=fsdp,
                source=held.source,
            )
    else:
        given = loader.settings
        geometry = data.Geometry(
            "custom",
            given.max_seq_len if given else cfg.max_seq_len,
            given.tokens_per_step if given else 0,
            "given by the caller",
            {"batching": Choice("custom", "a loader object was passed to the Trainer")},
        )
        if cfg.eval_data:
            eval_set = _custom_eval_set(cfg, loader, env.rank, env.world_size, fsdp)
    choices.update(geometry.choices)
    return loader, geometry, eval_set, data_key


def _with_run_choices(
    record: run_record.ChoiceRecord | None, choices: dict[str, Choice], dev: DeviceInfo
) -> run_record.ChoiceRecord | None:
    """The measured choices with the run's own measured ones added (precision, how
    `sdpa_docs` computes): written to choices.json before step 1, so --resume keeps them."""
    for name in ("precision", "attention_rows"):
        record = precision_record.record_choice(record, name, choices[name], dev)
    return record


def decide_attention_rows(
    cfg: RunConfig,
    m: _Machine,
    model: Any,
    loader: Loader,
    choices: dict[str, Choice],
    out: Path | None,
    autocast_dtype: torch.dtype | None,
    run_s: float | None,
) -> Choice:
    """How `sdpa_docs` computes on this CPU (train/attention_rows.py): kept by a resumed run,
    else decided at the run's micro-batch, weighed against the estimated run (`run_s`);
    applied to the model."""
    choice = precision_record.kept_choice(cfg, out, "attention_rows")
    if choice is None:
        settings = loader.settings
        length = settings.max_seq_len if settings is not None else cfg.max_seq_len
        request = attention_rows.RowsRequest(
            device_type=m.device.type,
            attention=str(choices["attention"].value),
            compiled=bool(choices["compile"].value),
            shape=attention_rows.attention_shape(
                model, settings.micro_rows if settings is not None else 1, length
            ),
            dtype=autocast_dtype or torch.float32,
            doc_len=attention_rows.typical_document(
                settings, length, getattr(loader, "lengths", None)
            ),
            run_s=run_s,
            layers=int(getattr(model.config, "num_hidden_layers", 1) or 1),
            available_bytes=int(psutil.virtual_memory().available),
            processes=m.env.world_size,
        )
        choice = attention_rows.decide_rows(request, cache_root(cfg.cache_dir))
    attention_rows.apply_rows(model, bool(choice.value))
    if choice.value:
        choice = attention_rows.checked_rows(model, m.device, autocast_dtype, m.precision, choice)
    return choice


def _seconds_per_position(cfg: RunConfig, m: _Machine, model: Any) -> float | None:
    """A position's estimated forward+backward on this device (FLOPs at an assumed MFU of
    its peak): what each first-run measurement is weighed against (batching/payoff.py)."""
    flops = cost_model.flops_model(model).per_token(cfg.max_seq_len)
    peak, _ = device_peak(m.dev, m.precision, bool(m.tf32.value), cache_root(cfg.cache_dir))
    return seconds_per_position(flops, peak, probe.ASSUMED_MFU_FOR_ESTIMATE)


def estimated_run_s(
    total_steps: int, geometry: data.Geometry, flops: cost_model.FlopsModel, peak: float | None
) -> float | None:
    """The planned run's estimated seconds (`probe.estimated_run_seconds`) that compile and
    the attention rows' timing are weighed against."""
    per_token = flops.per_token(geometry.flops_seq_len)
    return probe.estimated_run_seconds(total_steps, geometry.tokens_per_step, per_token, peak)


def plan_compute(
    cfg: RunConfig,
    m: _Machine,
    model: Any,
    geometry: data.Geometry,
    total_steps: int,
    choices: dict[str, Choice],
    faults: Faults = NO_FAULTS,
    settings: BatchSettings | None = None,
) -> tuple[cost_model.FlopsModel, float | None, str, Any, Any, compile_record.CompileTiming | None]:
    """(FLOPs model, device peak, its source, the wrapped model, what the forward calls,
    the timing of compile's cost and gain when this run measures it). FLOPs of the whole
    model, before any sharding; the distributed wrapper after `auto`'s timing (it times the
    plain model); compile decided by its measured payoff, or the estimated run time
    (train/compile_record.py)."""
    device = m.dev
    flops = cost_model.flops_model(model)
    peak_flops, peak_source = device_peak(
        device, m.precision, bool(m.tf32.value), cache_root(cfg.cache_dir)
    )
    est = estimated_run_s(total_steps, geometry, flops, peak_flops)
    wrapped, choices["strategy"] = distributed.wrap(model, cfg, m.env, precision=m.precision)
    key = compile_record.speed_key(
        cfg,
        device=device.name,
        world_size=m.env.world_size,
        settings=settings,
        attention=str(choices["attention"].value),
        precision=m.precision,
        threads=torch.get_num_threads() if device.type == "cpu" else None,
    )
    measured = compile_record.cached_speed(cfg.cache_dir, key) if cfg.compile != "off" else None
    choices["compile"] = probe.choose_compile(
        cfg.compile, device, est, steps=total_steps, measured=measured
    )
    compiled = bool(choices["compile"].value)
    timing = None
    if compiled:
        compile_record.inductor_cache(cfg.cache_dir)
        if measured is None and total_steps >= compile_record.FIRST_STEPS:
            timing = compile_record.CompileTiming(
                key, cfg.cache_dir, sync=partial(_sync, m.device), save=m.env.rank == 0
            )
    forward_model = wrapped
    if compiled:
        width = settings is not None and not settings.strategy.fixed_rows  # bucket
        forward_model = compile_module(wrapped, model, m.env.rank, faults, dynamic_width=width)
    return flops, peak_flops, peak_source, wrapped, forward_model, timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_optimizer_parts(
    cfg: RunConfig, m: _Machine, model: Any, choices: dict[str, Choice]
) -> tuple[torch.optim.Optimizer, torch.amp.GradScaler | None, bool]:
    """(optimizer, fp16 loss scaler, whether a bad step is skipped without a sync).
    After the wrapper: FSDP2 replaces the parameters by sharded DTensors."""
    env, tdev, precision = m.env, m.device, m.precision
    optimizer = build_optimizer(
        model,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        choice=choices["optimizer"],
        betas=parse_betas(cfg.adam_betas),
    )
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    # Fused AdamW takes a device-side found_inf flag: a non-finite step is skipped by
    # the kernel itself, without a host-device sync.
    sync_free_skip = (
        tdev.type == "cuda" and choices["optimizer"].value == "adamw_fused" and scaler is None
    )
    choices["loss"] = loss_choice(tdev.type, env.world_size)
    return optimizer, scaler, sync_free_skip


def build_writer(
    cfg: RunConfig,
    out: Path,
    m: _Machine,
    model: Any,
    tokenizer: Any,
    params: list[torch.nn.Parameter],
    eval_set: EvalSet | None,
    faults: Faults,
    choices: dict[str, Choice],
) -> checkpoint.CheckpointWriter:
    """The background checkpoint writer (rank 0 writes) and its policy for the banner."""
    env, tdev, fsdp = m.env, m.device, m.fsdp
    writer = checkpoint.CheckpointWriter(
        out / run_record.CHECKPOINTS,
        keep=cfg.save_total_limit,
        save_model=lambda dest, state: model_io.save_model_dir(model, tokenizer, dest, state),
        enabled=env.rank == 0,
        keep_best=eval_set is not None,
        faults=faults,
    )
    choices["checkpoints"] = Choice(
        memory_plan.save_policy(cfg),
        memory_plan.checkpoint_reason(model, params, choices["optimizer"], tdev, fsdp),
    )
    if eval_set is not None:
        choices["eval"] = eval_set.choice(cfg.eval_steps)
    return writer


def _custom_eval_set(
    cfg: RunConfig, loader: Loader, rank: int, world_size: int, fsdp: bool
) -> EvalSet:
    """Eval batches for a caller-given loader: its settings if it has them, else the config's."""
    settings = loader.settings or BatchSettings.from_config(
        cfg, world_size=world_size,
        strategy=Layout.PACK if cfg.batching == "auto" else cfg.batching,
    )  # fmt: skip
    if cfg.eval_data == "auto":
        raise ConfigError("--eval-data auto needs pitstop's own loader (it splits the store)")
    held = data.eval_data(cfg, None)
    assert held is not None
    return EvalSet(
        held.store,
        settings,
        indices=None,
        rank=rank,
        seed=cfg.seed,
        lockstep=fsdp,
        source=held.source,
    )
