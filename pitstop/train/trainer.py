"""The training loop as an object with named phases (torchtitan style).

`Trainer.fit()` runs optimizer steps, each made of the phases the step timeline
times: fetch_batch (data_wait), to_device (host_to_device), forward_backward
(forward, backward) per micro-batch, optimizer_step (optimizer); then, charged to
the next step, log (logging), evaluate (eval) and checkpoint (checkpoint).

The hot loop never synchronises host and device except at logging steps (every
cfg.log_steps), at checkpoints (copying state to host is a sync anyway) and, on
fp16 runs, inside GradScaler.step. Losses and gradient norms stay device tensors
until then; their metrics.jsonl lines are written at the next logging step.

metrics.jsonl, one line per optimizer step: step (1-based, steps done), epoch
(fractional), loss (mean CE per target token; null when skipped), lr, grad_norm,
skipped, trained_tokens / seen_tokens / padded_tokens (cumulative, all ranks),
step_trained_tokens, tokens_per_second (trained tokens of the step / step_seconds),
step_seconds, and `<phase>_s` seconds per phase of the step. A step that ran a
held-out evaluation (every --eval-steps, and the last step) also carries
eval_loss (mean CE per eval target token), eval_ppl (exp of it), eval_targets,
eval_sequences and eval_seconds on its own line; that evaluation's time is the
`eval_s` phase of the *next* step (like logging and checkpoints, it runs between
steps). TensorBoard and wandb get the same scalars (train/*, eval/loss, eval/ppl).

Several processes (torchrun, or --nproc): see `pitstop.train.distributed`. Rank 0
alone prints, logs and writes; timings are rank 0's. The other ranks agree with it
on stopping (SIGTERM) and time-based checkpoints at logging steps, the only points
where all ranks synchronise anyway.
"""

from __future__ import annotations

import math
import os
import random
import secrets
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pitstop import probe
from pitstop.atomic import write_json_atomic, write_text_atomic
from pitstop.config import RunConfig
from pitstop.errors import ConfigError, PitstopError
from pitstop.measure import flops as flops_mod
from pitstop.measure.peak import device_peak
from pitstop.measure.timeline import PHASES, StepRecord, Timeline
from pitstop.positions import check_positions
from pitstop.probe import Choice, DeviceInfo
from pitstop.train import checkpoint as ckpt
from pitstop.train import data as data_mod
from pitstop.train import distributed as dist_mod
from pitstop.train import model_io, optim
from pitstop.train.banner import format_banner, print_banner
from pitstop.train.optim import build_optimizer
from pitstop.train.schedule import default_warmup, lr_at
from pitstop.train.summary import (
    append_lines,
    peak_memory_bytes,
    truncate_metrics,
)

RUN_FILES = ("summary.json", "metrics.jsonl", "config.yaml")
RUN_DIRS = ("checkpoints", "final", "tensorboard")


class RunInterrupted(PitstopError):
    """SIGTERM/SIGINT: the run saved a checkpoint and stopped; the message says how to resume."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class TrainingDiverged(PitstopError):
    """Too many non-finite steps in a row."""

    exit_code = 1


def check_output_dir(cfg: RunConfig) -> Path:
    """Refuse to touch a directory holding a run unless --resume or --overwrite. Writes nothing."""
    problem = probe.output_dir_problem(cfg.output, resume=cfg.resume, overwrite=cfg.overwrite)
    if problem:
        raise ConfigError(problem)
    return Path(cfg.output)


def _clear_run(out: Path) -> None:
    """--overwrite: remove only what a pitstop run writes (never the user's other files)."""
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    for name in RUN_DIRS:
        if (out / name).exists():
            shutil.rmtree(out / name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


class _NullWriter:
    """Stands in for TensorBoard when it is off: the loop never asks whether it is on."""

    def add_scalar(self, *args: Any, **kwargs: Any) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _tensorboard(cfg: RunConfig, out: Path, enabled: bool) -> tuple[Any, str]:
    if not enabled:
        return _NullWriter(), "rank 0 writes the events"
    if "tensorboard" not in cfg.report_to:
        return _NullWriter(), "not in --report-to"
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print(
            "pitstop: TensorBoard logging skipped: the tensorboard package is not installed "
            "(pip install 'pitstop[tensorboard]')",
            file=sys.stderr,
        )
        return _NullWriter(), "tensorboard not installed"
    return SummaryWriter(log_dir=str(out / "tensorboard")), f"events in {out / 'tensorboard'}"


class _NullRun:
    """Stands in for a wandb run when wandb is off or not installed."""

    def log(self, data: dict[str, float], step: int) -> None:
        pass

    def finish(self) -> None:
        pass


def _wandb(cfg: RunConfig, out: Path, enabled: bool) -> tuple[Any, str]:
    """A wandb run logging the same scalars as TensorBoard; WANDB_MODE/PROJECT are respected.

    wandb is optional: not installed gives a one-line notice and no logging, never an error.
    """
    if not enabled:
        return _NullRun(), "rank 0 logs the run"
    if "wandb" not in cfg.report_to:
        return _NullRun(), "not in --report-to"
    try:
        import wandb
    except ImportError:
        print("pitstop: wandb logging skipped: the wandb package is not installed (pip install wandb)",
              file=sys.stderr)  # fmt: skip
        return _NullRun(), "wandb not installed"
    try:
        run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "pitstop"), name=out.name, dir=str(out),
            config=cfg.to_dict(), resume="allow",
        )  # fmt: skip
    except Exception as e:  # no login, no network in online mode...: the run goes on
        print(f"pitstop: wandb logging skipped: wandb.init failed ({type(e).__name__}: {e}); "
              "set WANDB_MODE=offline to log without a network", file=sys.stderr)  # fmt: skip
        return _NullRun(), f"wandb.init failed: {type(e).__name__}"
    mode = os.environ.get("WANDB_MODE", "online")
    return run, f"mode {mode}"


def _progress(total: int, initial: int) -> Any:
    from tqdm.auto import tqdm

    force = os.environ.get("PITSTOP_PROGRESS")
    disable = None if force is None else force == "0"  # None: only on a terminal
    return tqdm(
        total=total, initial=initial, unit="step", file=sys.stderr, disable=disable,
        dynamic_ncols=True, desc="train",
    )  # fmt: skip


class Trainer:
    """One training run. Build it with a validated RunConfig; `fit()` returns the summary.

    `device` overrides the probe (tests pretend machines with it); `loader` replaces
    the batching loader (any object honouring the loader contract in train/data.py).
    """

    def __init__(
        self,
        cfg: RunConfig,
        *,
        device: DeviceInfo | None = None,
        loader: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self.t_process = _process_start()
        self.cfg = cfg
        self.out = check_output_dir(cfg)
        seed_everything(cfg.seed)
        _quiet_transformers()

        # --- choices that need only the machine (may raise ConfigError: nothing written yet)
        self.choices: dict[str, Choice] = {}
        if device is None:
            device, dev_choice = probe.detect_device(cfg.device)
        else:
            dev_choice = Choice(device.torch_device, "given by the caller (probe overridden)")
        if rank is None and world_size is None:
            # Launched by torchrun: join its process group (and take GPU LOCAL_RANK).
            self.env, device = dist_mod.init(device)
        else:  # the caller places this trainer (a test, or a custom launcher with its own group)
            w = world_size or 1
            self.env = dist_mod.DistEnv(rank or 0, w, rank or 0, "gloo" if w > 1 else None)
        self.rank, self.world_size = self.env.rank, self.env.world_size
        self.is_main = self.rank == 0
        problems = dist_mod.check_strategy(cfg, self.env)
        if problems:
            raise ConfigError(problems, header="invalid configuration for several processes:")
        self.fsdp = self.env.distributed and cfg.strategy == "fsdp"
        self.dev = device
        self.device = torch.device(device.torch_device)
        self.choices["device"] = dev_choice
        prec = probe.choose_precision(cfg.precision, device)
        self.choices["precision"] = prec
        self.precision = prec.value
        tf32 = probe.choose_tf32(device, self.precision)
        self.choices["tf32"] = tf32
        probe.apply_backend_flags(device, tf32)
        attention = probe.choose_attention(cfg.attention, device, self.precision)
        self.choices["optimizer"] = optim.choose(cfg, device)

        # --- model (the directory is checked before the tokenizer reads its config)
        model_io.check_model_dir(Path(cfg.model), cfg.trust_remote_code)
        note = check_positions(cfg.model, cfg.max_seq_len)
        if note and self.is_main:
            print(f"pitstop: warning: {note}", file=sys.stderr)
        self.tokenizer = model_io.load_tokenizer(cfg)
        self.model, attention, lora = model_io.load_model(cfg, device, self.precision, attention)
        self.choices["attention"] = attention
        self.choices["gradient_checkpointing"] = Choice(
            cfg.gradient_checkpointing,
            "asked for: activations recomputed in backward (~1/3 more compute, far less memory)"
            if cfg.gradient_checkpointing
            else "off: activations kept (fastest; turn on with --gradient-checkpointing if memory is short)",
        )
        if lora is not None:
            self.choices["lora"] = lora
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        self.forward_model: Any = self.model
        self._compiled = False

        # --- data (after the model: `batching: auto` times each strategy on it)
        self.eval_set: Any = None
        if loader is None:
            store = data_mod.open_training_store(cfg)
            held = data_mod.eval_data(cfg, store)
            resume_strategy = data_mod.saved_strategy(self.out) if cfg.resume else None
            self.loader, self.geometry = data_mod.build_loader(
                cfg, store=store, rank=self.rank, world_size=self.world_size,
                run_micro_batch=self._timing_micro_batch, resume_strategy=resume_strategy,
                indices=held.train_indices if held else None, lockstep=self.fsdp,
            )  # fmt: skip
            if held is not None:
                from pitstop.train.evaluate import EvalSet

                self.eval_set = EvalSet(
                    held.store, self.loader.settings, indices=held.indices, rank=self.rank,
                    seed=cfg.seed, lockstep=self.fsdp, source=held.source,
                )  # fmt: skip
        else:
            self.loader = loader
            self.geometry = data_mod.Geometry(
                "custom", int(getattr(loader, "max_seq_len", cfg.max_seq_len)),
                int(getattr(loader, "tokens_per_step", 0)), "given by the caller",
                {"batching": Choice("custom", "a loader object was passed to the Trainer")},
            )  # fmt: skip
        if loader is not None and cfg.eval_data:
            self.eval_set = self._custom_eval_set(cfg, loader)
        self.choices.update(self.geometry.choices)
        self.steps_per_epoch = int(self.loader.steps_per_epoch)
        self.total_steps = int(
            getattr(self.loader, "total_steps", None)
            or data_mod.steps_for(cfg.epochs, cfg.max_steps, self.steps_per_epoch)
        )
        self.warmup = (
            cfg.warmup_steps if cfg.warmup_steps is not None else default_warmup(self.total_steps)
        )

        # --- FLOPs (of the whole model, before any sharding), peak, wrapping, compile
        self.flops = flops_mod.flops_model(self.model)
        self.flops_per_token = self.flops.per_token(self.geometry.max_seq_len)
        self.peak_flops, self.peak_source = device_peak(
            device, self.precision, bool(tf32.value), cfg.cache_dir or _default_cache()
        )
        est = None
        if self.peak_flops:
            est = (
                self.total_steps * self.geometry.tokens_per_step * self.flops_per_token
                / (self.peak_flops * probe.ASSUMED_MFU_FOR_ESTIMATE)
            )  # fmt: skip
        # After `batching: auto` (it times the plain model, no collectives), before the
        # optimizer (FSDP2 replaces the parameters by sharded DTensors).
        self.wrapped, self.choices["strategy"] = dist_mod.wrap(self.model, cfg, self.env)
        self.forward_model = self.wrapped
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.choices["compile"] = probe.choose_compile(cfg.compile, device, est)
        self._compiled = bool(self.choices["compile"].value)
        if self._compiled:
            self.forward_model = torch.compile(self.wrapped)

        # --- optimizer, precision machinery
        self.optimizer = build_optimizer(
            self.model,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            choice=self.choices["optimizer"],
            betas=optim.parse_betas(cfg.adam_betas),
        )
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" else None
        # Fused AdamW takes a device-side found_inf flag: a non-finite step is skipped by
        # the kernel itself, without a host-device sync.
        self.sync_free_skip = (
            self.device.type == "cuda" and self.choices["optimizer"].value == "adamw_fused"
            and self.scaler is None
        )  # fmt: skip
        self.choices["loss"] = Choice(
            "fp32 token CE / step_targets",
            "computed by pitstop from the logits in fp32, summed over targets and divided by the "
            "step's target count (all ranks), so accumulated micro-batches give exactly one big "
            "batch's gradient"
            + (f"; x{self.world_size} to undo the gradient averaging across ranks"
               if self.env.distributed else ""),
        )  # fmt: skip

        # --- counters (a resumed run restores them: the summary counts the whole run)
        self.step = 0
        self.trained_tokens = self.seen_tokens = self.padded_tokens = 0
        self.skipped_steps = 0
        self.bad_run = 0
        self.train_seconds = 0.0
        self.wall_before = 0.0
        self.ckpt_pause = 0.0
        self.phase_totals = dict.fromkeys(PHASES, 0.0)
        self.last_loss: float | None = None
        self.last_eval: dict[str, Any] | None = None
        self._last_ckpt_step: int | None = None  # on every rank (the writer lives on rank 0)
        self.resumed_from: str | None = None
        self.epoch_float = 0.0
        self._bad_run_t = torch.zeros((), device=self.device)
        self._skipped_t = torch.zeros((), device=self.device)
        self._stop_signal: int | None = None
        self._pending: list[dict[str, Any]] = []
        self.train_seconds_now = 0.0
        self.final_save_seconds = 0.0

        self.writer = ckpt.CheckpointWriter(
            self.out / "checkpoints",
            keep=cfg.save_total_limit,
            save_model=lambda dest, state: model_io.save_model_dir(
                self.model, self.tokenizer, dest, state
            ),
            enabled=self.is_main,
            keep_best=self.eval_set is not None,
        )
        self.choices["checkpoints"] = Choice(
            _save_policy(cfg),
            "asynchronous: the loop pauses only to copy state to host memory; a background "
            "thread writes atomically (partial dir, marker, rename)",
        )
        if self.eval_set is not None:
            every = f"every {cfg.eval_steps} steps and " if cfg.eval_steps else ""
            self.choices["eval"] = Choice(
                self.eval_set.source,
                f"held-out loss and perplexity {every}at the end, over {self.eval_set.n_targets:,} "
                "targets, batched like training; the checkpoint with the lowest eval loss is kept "
                "beside the newest (checkpoints/best.json)",
            )
        self._compute_loss = self._loss
        nan_steps = os.environ.get("PITSTOP_TEST_NAN_STEPS")  # test hook, see _nan_loss
        if nan_steps:
            self._nan_steps = {int(s) for s in nan_steps.split(",") if s}
            self._compute_loss = self._nan_loss
        self._stop_at = int(os.environ.get("PITSTOP_TEST_STOP_AT_STEP", "0")) or None  # test hook

    def _custom_eval_set(self, cfg: RunConfig, loader: Any) -> Any:
        """Eval batches for a caller-given loader: its settings if it has them, else the config's."""
        from pitstop.batching.settings import BatchSettings
        from pitstop.train.evaluate import EvalSet

        settings = getattr(loader, "settings", None) or BatchSettings.from_config(
            cfg, world_size=self.world_size,
            strategy="pack" if cfg.batching == "auto" else cfg.batching,
        )  # fmt: skip
        if cfg.eval_data == "auto":
            raise ConfigError("--eval-data auto needs pitstop's own loader (it splits the store)")
        held = data_mod.eval_data(cfg, None)
        assert held is not None
        return EvalSet(held.store, settings, indices=None, rank=self.rank, seed=cfg.seed,
                       lockstep=self.fsdp, source=held.source)  # fmt: skip

    # --- set-up of the output directory ----------------------------------------------

    def _prepare_output(self) -> None:
        out = self.out
        if self.cfg.overwrite and self.is_main:
            _clear_run(out)
        out.mkdir(parents=True, exist_ok=True)
        root = out / "checkpoints"
        if self.is_main:
            ckpt.remove_debris(root)
        latest = ckpt.latest_checkpoint(root) if self.cfg.resume else None
        # Every rank reads the same checkpoint (a shared filesystem across nodes).
        latest = dist_mod.broadcast_object(latest, self.env)
        if self.cfg.resume and latest is None and self.is_main:
            print(
                f"pitstop: no complete checkpoint in {root}; starting from step 0", file=sys.stderr
            )
        if latest is not None:
            self._restore(latest)
        if self.is_main:
            truncate_metrics(out / "metrics.jsonl", self.step)
            saved = RunConfig(**{**self.cfg.to_dict(), "resume": False, "overwrite": False})
            write_text_atomic(out / "config.yaml", saved.to_yaml())
        dist_mod.barrier(self.env)  # rank 0 has cleared/created what the others will write to

    def _restore(self, path: Path) -> None:
        st = ckpt.read_checkpoint(path)
        if self.fsdp:
            # Saved as full (unsharded) state by name; every rank loads it and keeps its shard.
            dist_mod.load_full_state(
                self.model, self.optimizer, model_io.read_weights(path, self.model),
                st["optimizer"]["optimizer"],
            )  # fmt: skip
        else:
            model_io.load_weights(self.model, path)
            self.optimizer.load_state_dict(st["optimizer"]["optimizer"])
        if self.scaler is not None and st["optimizer"].get("scaler"):
            self.scaler.load_state_dict(st["optimizer"]["scaler"])
        ckpt.set_rng_state(st["rng"])
        self.loader.load_state_dict(st["loader_state"])
        ts = st["trainer_state"]
        self.step = int(ts["step"])
        self.trained_tokens = int(ts["trained_tokens"])
        self.seen_tokens = int(ts["seen_tokens"])
        self.padded_tokens = int(ts["padded_tokens"])
        self.skipped_steps = int(ts["skipped_steps"])
        self.bad_run = int(ts["bad_run"])
        self.train_seconds = float(ts["train_seconds"])
        self.wall_before = float(ts["wall_seconds"])
        self.ckpt_pause = float(ts["checkpoint_pause_seconds"])
        self.phase_totals.update(ts["time_breakdown"])
        self.last_loss = ts.get("last_loss")
        self.epoch_float = float(ts.get("epoch", 0.0))
        self.last_eval = ts.get("last_eval")
        self._last_ckpt_step = self.step
        self._bad_run_t.fill_(self.bad_run)
        self._skipped_t.fill_(self.skipped_steps)
        self.resumed_from = str(path)
        self.writer.last_written = path

    def _timing_micro_batch(self, mb: dict[str, Any]) -> float:
        """One forward+backward for `batching: auto`'s timing; gradients are thrown away."""
        loss = self._loss(self.to_device(mb))
        loss.backward()
        self.model.zero_grad(set_to_none=True)
        return float(loss.item())  # the sync makes the timing cover the device work

    # --- phases ---------------------------------------------------------------------

    def fetch_batch(self) -> dict[str, Any]:
        return next(self._batches)

    def to_device(self, mb: dict[str, Any]) -> dict[str, torch.Tensor]:
        nb = self.device.type == "cuda"  # pinned host batches copy asynchronously
        return {
            k: mb[k].to(self.device, non_blocking=nb)
            for k in ("input_ids", "labels", "position_ids")
        }

    def _loss(self, batch: dict[str, torch.Tensor], model: Any = None) -> torch.Tensor:
        """Sum of token cross-entropies over the targets of a micro-batch (fp32 scalar).

        `model`: call this module instead of the training forward (evaluation).
        """
        with torch.autocast(
            self.device.type, dtype=self.autocast_dtype or torch.float32,
            enabled=self.autocast_dtype is not None,
        ):  # fmt: skip
            out = self._forward(batch, model)
        logits = out.logits  # [B, T, V]
        labels = batch["labels"]  # [B, T]; the model convention: position t predicts labels[t+1]
        return F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(),  # [B*(T-1), V] in fp32
            labels[:, 1:].flatten(),  # [B*(T-1)]
            ignore_index=-100,
            reduction="sum",
        )

    def _nan_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Test hook (PITSTOP_TEST_NAN_STEPS=3,4): poison the loss of those steps (1-based)."""
        loss = self._loss(batch)
        if self.step + 1 in self._nan_steps:
            loss = loss * float("nan")
        return loss

    def _forward(self, batch: dict[str, torch.Tensor], model: Any = None) -> Any:
        # No attention_mask: the model derives a block-diagonal causal mask from position_ids
        # (documents packed in one row never attend to each other).
        kwargs = {
            "input_ids": batch["input_ids"],
            "position_ids": batch["position_ids"],
            "use_cache": False,
        }
        if model is not None:
            return model(**kwargs)
        if not self._compiled:
            return self.forward_model(**kwargs)
        try:
            return self.forward_model(**kwargs)
        except Exception as e:  # --compile on must never crash the run
            print(f"pitstop: warning: torch.compile failed ({type(e).__name__}: {e}); "
                  "continuing without compile", file=sys.stderr)  # fmt: skip
            self.forward_model, self._compiled = self.model, False
            self.choices["compile"] = Choice(False, f"compile failed ({type(e).__name__}); eager")
            return self.forward_model(**kwargs)

    def forward_backward(
        self, batch: dict[str, torch.Tensor], step_targets: int, tl: Timeline, *, last: bool = True
    ) -> torch.Tensor:
        """One micro-batch; returns its share of the step's loss (sum CE / step targets).

        `last`: the step's last micro-batch on this rank, the one whose backward
        communicates gradients (DDP no_sync / FSDP2 gradient sync off before it).
        """
        with dist_mod.no_sync(self.wrapped, self.cfg.strategy, last):
            with tl.phase("forward"):
                loss = self._compute_loss(batch) / max(step_targets, 1)
            # DDP/FSDP average gradients over ranks; the step's gradient is their sum.
            scaled = loss * self.world_size if self.world_size > 1 else loss
            with tl.phase("backward"):
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return loss.detach()

    def optimizer_step(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Clip, skip if non-finite, step. Returns (grad norm, skipped flag tensor, lr)."""
        lr = lr_at(self.step, peak_lr=self.cfg.lr, total_steps=self.total_steps,
                   warmup_steps=self.warmup, schedule=self.cfg.schedule,
                   min_lr_ratio=self.cfg.min_lr_ratio)  # fmt: skip
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.cfg.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm(
                [p.grad for p in self.params if p.grad is not None]
            )
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
            norm = norm.full_tensor()
        if self.env.distributed:
            # The norm is the same on every rank (reduced gradients); the local loss is not,
            # and ranks must agree on skipping. A non-finite loss makes non-finite gradients.
            bad = ~torch.isfinite(norm)
        else:
            bad = ~(torch.isfinite(norm) & torch.isfinite(loss))  # 0-dim bool on the device
        if self.sync_free_skip:
            self.optimizer.found_inf = bad.float()  # the fused kernel skips the update itself
            self.optimizer.step()
            self.optimizer.found_inf = None
        elif self.scaler is not None:
            self.scaler.step(self.optimizer)  # syncs internally; skips inf grads (loss scale)
            self.scaler.update()
        elif not bool(bad):  # CPU: reading a CPU tensor is no device sync
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.detach(), bad, lr

    # --- the loop -----------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        self._prepare_output()
        self.tb, tb_note = _tensorboard(self.cfg, self.out, self.is_main)
        self.choices["tensorboard"] = Choice(bool(not isinstance(self.tb, _NullWriter)), tb_note)
        self.wb, wb_note = _wandb(self.cfg, self.out, self.is_main)
        if "wandb" in self.cfg.report_to:
            self.choices["wandb"] = Choice(not isinstance(self.wb, _NullRun), wb_note)
        if self.is_main:
            print_banner(self._banner())
        self._batches = iter(self.loader)
        old_handlers = self._install_signals()
        bar = _progress(self.total_steps, self.step) if self.is_main else None
        tl = Timeline(use_cuda_events=self.device.type == "cuda")
        last_save_time = time.monotonic()
        t_train0 = time.perf_counter()
        status = "failed"
        ok = False
        try:
            tl.start_step()
            while self.step < self.total_steps:
                self._train_step(tl)
                rec = tl.end_step()
                tl.start_step()  # logging, eval and checkpoint below count toward the next step
                self._pending[-1]["record"] = rec
                if bar is not None:
                    bar.update(1)
                done = self.step >= self.total_steps
                save_due = bool(self.cfg.save_steps and self.step % self.cfg.save_steps == 0)
                log_due = self.step % self.cfg.log_steps == 0 or done
                time_due = (
                    self.cfg.save_minutes is not None
                    and time.monotonic() - last_save_time >= 60 * self.cfg.save_minutes
                )
                signalled = self._stop_signal is not None
                if self.env.distributed:  # ranks act on these together, at logging steps only
                    time_due, signalled = self._agree(time_due, signalled, now=log_due or save_due)
                save_due = save_due or time_due
                stop = signalled or self.step == self._stop_at
                self.train_seconds_now = self.train_seconds + time.perf_counter() - t_train0
                eval_due = self._eval_due(done)
                if eval_due:  # before logging: the result goes on this step's metrics line
                    with tl.phase("eval"):
                        self.evaluate()
                if log_due or save_due or stop or eval_due:
                    with tl.phase("logging"):
                        self.log(bar)
                if (save_due or stop) and not done:
                    with tl.phase("checkpoint"):
                        self.checkpoint(t_train0)
                    last_save_time = time.monotonic()
                if stop and not done:
                    self.writer.wait()
                    status = "interrupted"
                    raise self._interrupted()
            ok = True
        except TrainingDiverged:
            status = "diverged"
            raise
        finally:
            if bar is not None:
                bar.close()
            self._restore_signals(old_handlers)
            train_end = time.perf_counter()
            leftover = tl.end_step()  # time after the last step (its logging): counted too
            for k, v in leftover.resolve().items():
                if k != "other":
                    self.phase_totals[k] += v
            self.train_seconds += train_end - t_train0
            if not ok:
                self._finish_quietly(status)
        status = "completed"
        self._final_save(t_train0)
        summary = self.summary(status)
        if self.is_main:
            write_json_atomic(self.out / "summary.json", summary)
            print(_result_line(summary), file=sys.stderr)
        self.tb.close()
        self.wb.finish()
        # Ranks leave together: a rank that tears down gloo while rank 0 still writes the
        # final model was seen to abort ("terminate called without an active exception").
        dist_mod.barrier(self.env)
        return summary

    def close(self) -> None:
        """Leave the process group (torchrun runs); safe to call more than once."""
        dist_mod.shutdown(self.env)

    def _agree(self, *flags: bool, now: bool) -> tuple[bool, ...]:
        """Each flag true on any rank, at points all ranks reach together; False elsewhere."""
        if not now:
            return tuple(False for _ in flags)
        t = torch.tensor([float(f) for f in flags], device=self.device)
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return tuple(bool(v) for v in t.tolist())

    def _train_step(self, tl: Timeline) -> None:
        loss_acc = torch.zeros((), device=self.device)
        n_targets = n_seen = n_pos = 0
        meta: dict[str, Any] = {}
        micro_count = 1
        m = 0
        while m < micro_count:
            with tl.phase("data_wait"):
                mb = self.fetch_batch()
            meta = mb["meta"]
            micro_count = int(meta["micro_count"])
            with tl.phase("host_to_device"):
                batch = self.to_device(mb)
            last = m == micro_count - 1
            loss_acc += self.forward_backward(batch, int(meta["step_targets"]), tl, last=last)
            n_targets += int(meta["n_targets"])
            n_seen += int(meta["n_seen"])
            n_pos += int(meta["n_positions"])
            m += 1
        with tl.phase("optimizer"):
            norm, bad, lr = self.optimizer_step(loss_acc)
        self.step += 1
        # The fraction of the *current* epoch: meta["step"] counts from the start of the run.
        epoch = int(meta["epoch"])
        if "epoch_step" in meta:
            in_epoch = int(meta["epoch_step"])
        else:  # a caller's loader without it: epochs of steps_per_epoch steps each
            in_epoch = int(meta["step"]) - epoch * self.steps_per_epoch
        self.epoch_float = epoch + (in_epoch + 1) / self._steps_in_epoch(epoch)
        # Device-side bad-step bookkeeping: read only at logging steps.
        self._bad_run_t = (self._bad_run_t + 1) * bad
        self._skipped_t = self._skipped_t + bad
        # Token counts are this rank's; log() sums them over ranks with the loss.
        self._pending.append({
            "step": self.step, "epoch": round(self.epoch_float, 6), "loss": loss_acc, "lr": lr,
            "grad_norm": norm, "bad": bad, "counts": (n_targets, n_seen, n_pos),
            "bad_run": self._bad_run_t,
        })  # fmt: skip

    def _steps_in_epoch(self, epoch: int) -> int:
        """Steps of `epoch` (bucket and pad plans may differ by a step between epochs)."""
        fn = getattr(self.loader, "steps_in_epoch", None)
        return int(fn(epoch)) if fn is not None else self.steps_per_epoch

    def log(self, bar: Any = None) -> None:
        """The logging step: the one place the loop reads device values (a sync)."""
        if not self._pending:
            return
        # Summed over ranks: [n, 4] (loss share, targets, seen, positions), float64 so the
        # counts stay exact; one collective per logging step.
        summed = torch.stack([
            torch.cat([p["loss"].double().reshape(1),
                       torch.tensor(p["counts"], dtype=torch.float64).to(self.device)])
            for p in self._pending
        ])  # fmt: skip
        dist_mod.all_reduce_sum(summed, self.env)
        # The same on every rank: [n, 3] (grad norm, bad, bad run). One transfer for all.
        same = torch.stack([
            torch.stack([p["grad_norm"].double(), p["bad"].double(), p["bad_run"].double()])
            for p in self._pending
        ])  # fmt: skip
        vals = torch.cat([summed, same], dim=1).tolist()
        lines = []
        for p, (loss, n_t, n_s, n_p, norm, bad, bad_run) in zip(self._pending, vals):
            rec: StepRecord = p.pop("record")
            phases = rec.resolve()
            for k, v in phases.items():
                self.phase_totals[k] += v
            skipped = bool(bad)
            self.trained_tokens += int(n_t)
            self.seen_tokens += int(n_s)
            self.padded_tokens += int(n_p)
            drop = ("loss", "grad_norm", "bad", "bad_run", "counts")
            line = {k: v for k, v in p.items() if k not in drop}
            line.update({
                "loss": None if skipped else loss, "grad_norm": norm, "skipped": skipped,
                "trained_tokens": self.trained_tokens, "seen_tokens": self.seen_tokens,
                "padded_tokens": self.padded_tokens, "step_trained_tokens": int(n_t),
                "tokens_per_second": int(n_t) / rec.step_seconds if rec.step_seconds > 0 else None,
                "step_seconds": rec.step_seconds,
                **{f"{k}_s": v for k, v in phases.items()},
            })  # fmt: skip
            lines.append(line)
            if skipped:
                self.skipped_steps += 1
                self.bad_run = int(bad_run)
                if self.bad_run >= self.cfg.max_bad_steps:
                    self._pending = []
                    if self.is_main:
                        append_lines(self.out / "metrics.jsonl", lines)
                    self._diverged(p["step"], p["lr"], loss, norm)
            else:
                self.bad_run = 0
                self.last_loss = loss
        self._pending = []
        if not self.is_main:
            return
        append_lines(self.out / "metrics.jsonl", lines)
        last = lines[-1]
        for line in lines:
            scalars = {
                **{f"train/{k}": line[k] for k in ("loss", "lr", "grad_norm", "tokens_per_second")},
                **{f"eval/{k[5:]}": line[k] for k in ("eval_loss", "eval_ppl") if k in line},
            }
            scalars = {k: v for k, v in scalars.items() if v is not None and math.isfinite(v)}
            for key, v in scalars.items():
                self.tb.add_scalar(key, v, line["step"])
            self.wb.log(scalars, step=line["step"])
        self.tb.flush()
        tps = self.trained_tokens / self.train_seconds_now if self.train_seconds_now > 0 else 0.0
        if bar is not None and not bar.disable:
            bar.set_postfix(loss=f"{last['loss']:.4f}" if last["loss"] is not None else "skip",
                            tok_s=f"{tps:,.0f}", refresh=False)  # fmt: skip
        elif bar is not None:
            loss_s = f"{last['loss']:.4f}" if last["loss"] is not None else "skipped"
            print(f"step {last['step']}/{self.total_steps}  loss {loss_s}  lr {last['lr']:.3g}  "
                  f"{tps:,.0f} tokens/s", file=sys.stderr, flush=True)  # fmt: skip

    def _diverged(self, step: int, lr: float, loss: float, norm: float) -> None:
        # A checkpoint may still be on its way to disk: let it land before naming it.
        self.writer.wait()
        last = self.writer.last_written
        raise TrainingDiverged(
            f"training stopped at step {step}: {self.bad_run} optimizer steps in a row had a "
            f"non-finite loss or gradient (loss {loss}, gradient norm {norm}, learning rate {lr:.3g}); "
            f"those steps were skipped. The last good checkpoint is {last or 'none (no checkpoint yet)'}. "
            "Try a lower --lr, a longer warm-up (--warmup-steps), or --precision bf16/fp32 instead of fp16"
        )

    def _eval_due(self, done: bool) -> bool:
        if self.eval_set is None:
            return False
        every = self.cfg.eval_steps
        return done or bool(every and self.step % every == 0)

    def evaluate(self) -> dict[str, Any]:
        """Held-out loss and perplexity now; attached to the newest pending metrics line.

        Uses the unwrapped model (no DDP hooks; FSDP2's module gathers its shards), in eval
        mode (no dropout), without gradients. All ranks take part: the sums are all-reduced.
        """
        assert self.eval_set is not None
        t0 = time.perf_counter()
        was_training = self.model.training
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        try:
            with torch.no_grad():
                for mb in self.eval_set.batches():
                    total += self._loss(self.to_device(mb), model=self.model).double()
        finally:
            self.model.train(was_training)
        dist_mod.all_reduce_sum(total, self.env)
        res = self.eval_set.result(float(total.item()), self.step, time.perf_counter() - t0)
        self.last_eval = res
        if self._pending and self._pending[-1]["step"] == self.step:
            self._pending[-1].update({k: v for k, v in res.items() if k != "step"})
        return res

    # --- checkpoints ----------------------------------------------------------------

    def _trainer_state(self, t_train0: float) -> dict[str, Any]:
        return {
            "step": self.step, "epoch": self.epoch_float, "total_steps": self.total_steps,
            "trained_tokens": self.trained_tokens, "seen_tokens": self.seen_tokens,
            "padded_tokens": self.padded_tokens, "skipped_steps": self.skipped_steps,
            "bad_run": self.bad_run,
            "train_seconds": self.train_seconds + time.perf_counter() - t_train0,
            "wall_seconds": self.wall_before + time.time() - self.t_process,
            "checkpoint_pause_seconds": self.ckpt_pause,
            "time_breakdown": self.phase_totals, "last_loss": self.last_loss,
            "last_eval": self.last_eval,
            # Read by checkpoint retention: the best checkpoint by eval loss is kept.
            "eval_loss": self.last_eval["eval_loss"]
            if self.last_eval and self.last_eval["step"] == self.step else None,
        }  # fmt: skip

    def checkpoint(self, t_train0: float, *, blocking: bool = False) -> None:
        """Pause only to copy state to host memory; the writer thread does the rest."""
        t0 = time.perf_counter()
        self.log()  # lines up to this step must exist before the checkpoint does
        self._last_ckpt_step = self.step
        if self.fsdp:
            # Collective: every rank sends its shards; rank 0 gets full CPU copies.
            model_state = dist_mod.full_state(self.model)
            optim_state = dist_mod.full_optimizer_state(self.model, self.optimizer)
        if not self.is_main:  # DDP: rank 0's replica is the same as this one
            self.ckpt_pause += time.perf_counter() - t0
            return
        self.writer.wait()  # the previous write must be done (and must have succeeded)
        if not self.fsdp:
            model_state = ckpt.to_host(model_io.trainable_state(self.model))
            optim_state = ckpt.to_host(self.optimizer.state_dict())
        snap = ckpt.Snapshot(
            step=self.step,
            model_state=model_state,
            optimizer={
                "optimizer": optim_state,
                "scaler": ckpt.to_host(self.scaler.state_dict())
                if self.scaler is not None
                else None,
            },
            trainer_state=self._trainer_state(t_train0),
            rng=ckpt.rng_state(),
            loader_state=self.loader.state_dict(),
        )
        self.writer.submit(snap, blocking=blocking)
        self.ckpt_pause += time.perf_counter() - t0

    def _final_save(self, t_train0: float) -> None:
        """Always: a last checkpoint (unless this step has one) and final/ (HF-loadable)."""
        if self._last_ckpt_step != self.step:
            self.checkpoint(t_train0)  # on every rank: FSDP gathers the state collectively
        t0 = time.perf_counter()
        state = dist_mod.full_state(self.model) if self.fsdp else None
        if not self.is_main:
            return
        tmp = self.out / f".final.partial-{secrets.token_hex(4)}"
        tmp.mkdir()
        model_io.save_final(self.model, self.tokenizer, tmp, state, self.cfg)
        model_io.publish_dir(tmp, self.out / "final")
        if self.cfg.merge_lora and model_io.is_peft(self.model):
            from pitstop.train.export import merge_adapter

            merge_adapter(self.out / "final", self.out / "merged")
        self.writer.wait()
        self.final_save_seconds = time.perf_counter() - t0

    def _finish_quietly(self, status: str) -> None:
        """On a stop: let the checkpoint writer finish, record the summary, keep the error."""
        try:
            self.writer.wait()
        except ckpt.CheckpointError as e:
            print(f"pitstop: {e}", file=sys.stderr)
        if self.is_main:
            write_json_atomic(self.out / "summary.json", self.summary(status))
        self.tb.close()
        self.wb.finish()

    # --- signals ------------------------------------------------------------------

    def _install_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        old = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            old[sig] = signal.signal(sig, self._on_signal)
        return old

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._stop_signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self._stop_signal = signum
        if not self.is_main:
            return
        print(f"\npitstop: {signal.Signals(signum).name} received: finishing step {self.step + 1}, "
              "then saving a checkpoint (Ctrl-C again to stop at once)", file=sys.stderr)  # fmt: skip

    def _restore_signals(self, old: dict[int, Any]) -> None:
        for sig, h in old.items():
            signal.signal(sig, h)

    def _interrupted(self) -> RunInterrupted:
        signum = self._stop_signal or signal.SIGTERM
        cmd = f"pitstop train --config {self.out / 'config.yaml'} --resume"
        return RunInterrupted(
            f"stopped by {signal.Signals(signum).name} after step {self.step} of {self.total_steps}; "
            f"checkpoint saved in {self.writer.last_written}. Resume with:\n  {cmd}",
            exit_code=128 + int(signum),
        )

    # --- reporting ------------------------------------------------------------------

    def _banner(self) -> str:
        g = self.geometry
        n_params = sum(p.numel() for p in self.model.parameters())
        facts = {
            "model": f"{self.cfg.model} ({n_params / 1e6:.1f}M parameters)",
            "data": f"{self.steps_per_epoch} optimizer steps per epoch",
            "run": f"{self.total_steps} optimizer steps of {g.tokens_per_step:,} tokens "
            f"(rows of {g.max_seq_len}, {g.micro})",
            "lr": f"{self.cfg.lr:g}, {self.warmup} warm-up steps, {self.cfg.schedule} to "
            f"{self.cfg.min_lr_ratio:g}x; clip {self.cfg.max_grad_norm:g}",
            "output": str(self.out) + (f" (resuming from {self.resumed_from})" if self.resumed_from else ""),
            "peak": f"{self.peak_flops / 1e12:.3f} TFLOP/s ({self.peak_source})"
            if self.peak_flops else self.peak_source,
        }  # fmt: skip
        return format_banner(self.dev.name, facts, self.choices)

    def summary(self, status: str) -> dict[str, Any]:
        ts = self.train_seconds
        mfu = (
            flops_mod.mfu(self.padded_tokens / ts, self.flops_per_token, self.peak_flops)
            if ts > 0
            else None
        )
        eff = self.seen_tokens / self.padded_tokens if self.padded_tokens else None  # measured
        return {
            "status": status,
            "optimizer_steps": self.step,
            "total_steps": self.total_steps,
            "epochs": self.epoch_float,
            "trained_tokens": self.trained_tokens,
            "seen_tokens": self.seen_tokens,
            "padded_tokens": self.padded_tokens,
            "train_seconds": ts,
            "wall_seconds": self.wall_before + time.time() - self.t_process,
            "tokens_per_second": self.trained_tokens / ts if ts > 0 else None,
            "seen_tokens_per_second": self.seen_tokens / ts if ts > 0 else None,
            "mfu": mfu,
            "flops_per_token": self.flops_per_token,
            "peak_flops": self.peak_flops,
            "peak_flops_source": self.peak_source,
            "peak_memory_bytes": peak_memory_bytes(self.device.type),
            "final_loss": self.last_loss,
            "eval_loss": self.last_eval["eval_loss"] if self.last_eval else None,
            "eval_ppl": self.last_eval["eval_ppl"] if self.last_eval else None,
            "eval": self.last_eval,
            "best_checkpoint": self.writer.best,
            "world_size": self.world_size,
            "time_breakdown": dict(self.phase_totals),
            "checkpoint_pause_seconds": self.ckpt_pause,
            "checkpoint_write_seconds": self.writer.write_seconds,
            "skipped_steps": self.skipped_steps,
            "packing_efficiency": eff,
            "padding_waste": 1 - eff if eff is not None else None,
            "planned_efficiency": self.geometry.efficiency,  # epoch 0 plan, before running
            "device": {**self.dev.to_dict(), "torch": torch.__version__},
            "choices": {k: c.to_dict() for k, c in self.choices.items()},
            "resumed_from": self.resumed_from,
            "final_model": str(self.out / "final") if status == "completed" else None,
            "config": self.cfg.to_dict(),
        }


def _save_policy(cfg: RunConfig) -> str:
    parts = []
    if cfg.save_steps:
        parts.append(f"every {cfg.save_steps} steps")
    if cfg.save_minutes:
        parts.append(f"every {cfg.save_minutes:g} min")
    parts.append("at the end")
    return ", ".join(parts) + f"; keep {cfg.save_total_limit}"


def _result_line(s: dict[str, Any]) -> str:
    mfu = f", MFU {100 * s['mfu']:.1f}%" if s["mfu"] is not None else ""
    loss = f"{s['final_loss']:.4f}" if s["final_loss"] is not None else "n/a"
    return (
        f"pitstop: {s['optimizer_steps']} steps, {s['trained_tokens']:,} trained tokens in "
        f"{s['train_seconds']:.1f} s ({(s['tokens_per_second'] or 0):,.0f} tokens/s{mfu}); "
        f"final loss {loss}; model in {s['final_model']}"
    )


def _quiet_transformers() -> None:
    """save_pretrained's per-shard progress bars would interleave with the run's own bar."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def _process_start() -> float:
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # psutil is a dependency, but a missing /proc must not stop a run
        return time.time()


def _default_cache() -> str:
    return os.environ.get("PITSTOP_CACHE_DIR") or str(Path.home() / ".cache" / "pitstop")
