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
step_seconds, mfu (of the step's computed positions; null when the device peak is
unknown), and `<phase>_s` seconds per phase of the step; the last line of each
logging step also carries peak_memory_gib (the process's peak so far). A step that ran a
held-out evaluation (every --eval-steps, and the last step) also carries
eval_loss (mean CE per eval target token), eval_ppl (exp of it), eval_targets,
eval_sequences and eval_seconds on its own line; that evaluation's time is the
`eval_s` phase of the *next* step (like logging and checkpoints, it runs between
steps). TensorBoard and wandb get the same scalars (train/*, eval/*, time/<phase>,
memory/peak_gib: train/run_log.py).

Several processes (torchrun, or --nproc): see `pitstop.train.distributed`. Rank 0
alone prints, logs and writes; timings are rank 0's. The other ranks agree with it
on stopping (SIGTERM) and time-based checkpoints at logging steps, the only points
where all ranks synchronise anyway.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from pitstop import log, run_record
from pitstop import runlock as run_lock
from pitstop.atomic import write_text_atomic
from pitstop.batching.choices import write_run_choices
from pitstop.batching.records import MicroBatchMeta
from pitstop.config import RunConfig
from pitstop.errors import PitstopError
from pitstop.measure import flops as flops_mod
from pitstop.measure.timeline import StepRecord, Timeline
from pitstop.probe import Choice, DeviceInfo
from pitstop.run_record import RunSummary, write_summary
from pitstop.train import checkpoint as ckpt
from pitstop.train import distributed as dist_mod
from pitstop.train import guard, model_io, oom
from pitstop.train import resume as resume_mod
from pitstop.train.banner import format_banner, print_banner
from pitstop.train.build import Run, build_run, to_device, token_loss_sum
from pitstop.train.hooks import NoHooks, StepHooks
from pitstop.train.run_log import RunLog
from pitstop.train.schedule import lr_at
from pitstop.train.state import RunState
from pitstop.train.summary import peak_memory_bytes, result_line, trainer_summary, truncate_metrics


class RunInterrupted(PitstopError):
    """SIGTERM/SIGINT: the run saved a checkpoint and stopped; the message says how to resume."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class TrainingDiverged(PitstopError):
    """Too many non-finite steps in a row."""

    exit_code = 1


def _clear_run(out: Path) -> None:
    """--overwrite: remove only what a pitstop run writes (never the user's other files)."""
    for name in run_record.RUN_FILES:
        (out / name).unlink(missing_ok=True)
    for name in run_record.RUN_DIRS:
        if (out / name).exists():
            shutil.rmtree(out / name)


class Trainer:
    """One training run's loop. `fit()` returns the summary.

    It receives what `pitstop.train.build.build_run` assembled (`run=`); given only a
    validated RunConfig it builds that itself, passing `device` (overrides the probe:
    tests pretend machines with it), `loader` (replaces the batching loader: any object
    honouring the loader contract in train/data.py), `rank` and `world_size` on.
    `hooks` are called at each step's start and end (train/hooks.py); `save_final=False`
    skips final/ (a measurement run: writing it can take minutes for a large model).
    """

    def __init__(
        self,
        cfg: RunConfig,
        *,
        device: DeviceInfo | None = None,
        loader: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        hooks: StepHooks | None = None,
        save_final: bool = True,
        run: Run | None = None,
    ) -> None:
        if run is None:
            run = build_run(cfg, device=device, loader=loader, rank=rank, world_size=world_size)
        self.run = run
        self.hooks: StepHooks = hooks if hooks is not None else NoHooks()
        self.save_final = save_final  # False: a measurement run keeps no final model
        self.t_process = run.t_process
        self.cfg, self.out = run.cfg, run.out
        self.env, self.dev, self.device = run.env, run.dev, run.device
        self.rank, self.world_size = self.env.rank, self.env.world_size
        self.is_main = self.rank == 0
        self.fsdp = run.fsdp
        self.choices = run.choices
        self.precision, self.autocast_dtype = run.precision, run.autocast_dtype
        self.tokenizer, self.model, self.wrapped = run.tokenizer, run.model, run.wrapped
        self.forward_model, self._compiled = run.forward_model, run.compiled
        self.loader, self.geometry, self.eval_set = run.loader, run.geometry, run.eval_set
        self.steps_per_epoch, self.total_steps = run.steps_per_epoch, run.total_steps
        self.warmup = run.warmup
        self.flops, self.flops_per_token = run.flops, run.flops_per_token
        self.peak_flops, self.peak_source = run.peak_flops, run.peak_source
        self.params, self.optimizer, self.scaler = run.params, run.optimizer, run.scaler
        self.sync_free_skip = run.sync_free_skip
        self.writer = run.writer
        self.data_key = run.data_key

        # --- the run's state (a resumed run restores it: the summary counts the whole run)
        self.state = RunState()
        self._last_ckpt_step: int | None = None  # on every rank (the writer lives on rank 0)
        self._ckpt_copy: Any = None  # the CUDA event of a checkpoint copy still in flight
        self.resumed_from: str | None = None
        self._bad_run_t = torch.zeros((), device=self.device)
        self._skipped_t = torch.zeros((), device=self.device)
        self._stop_signal: int | None = None
        self._pending: list[dict[str, Any]] = []
        self.train_seconds_now = 0.0
        self.final_save_seconds = 0.0

        self._compute_loss = self._loss
        nan_steps = os.environ.get("PITSTOP_TEST_NAN_STEPS")  # test hook, see _nan_loss
        if nan_steps:
            self._nan_steps = {int(s) for s in nan_steps.split(",") if s}
            self._compute_loss = self._nan_loss
        self._stop_at = int(os.environ.get("PITSTOP_TEST_STOP_AT_STEP", "0")) or None  # test hook
        # Test hook PITSTOP_TEST_OOM_ROWS="STEP:ROWS": a micro-batch of more than ROWS rows
        # in step STEP (1-based) raises a CUDA out-of-memory error (see _back_off).
        at = os.environ.get("PITSTOP_TEST_OOM_ROWS")
        self._oom_rows = tuple(int(x) for x in at.split(":")) if at else None
        self._oom_retryable = False  # the OOM came from a forward/backward (a backoff may help)

    # --- set-up of the output directory ----------------------------------------------

    def _prepare_output(self) -> None:
        out = self.out
        if self.cfg.overwrite and self.is_main:
            _clear_run(out)
        out.mkdir(parents=True, exist_ok=True)
        root = out / run_record.CHECKPOINTS
        if self.is_main:
            ckpt.remove_debris(root)
        # Refuses (touching nothing) when checkpoints exist and none is complete.
        latest = (
            resume_mod.choose_checkpoint(out, announce=self.is_main) if self.cfg.resume else None
        )
        # Every rank reads the same checkpoint (a shared filesystem across nodes).
        latest = dist_mod.broadcast_object(latest, self.env)
        if latest is not None:
            self._restore(latest)
        if self.is_main:
            truncate_metrics(out / run_record.METRICS, self.state.step)
            saved = RunConfig(**{
                **self.cfg.to_dict(), "resume": False, "overwrite": False,
                "resume_with_changes": False,
            }).to_yaml()  # fmt: skip
            kept = resume_mod.keep_previous_config(out, saved, self.state.step) if latest else None
            if kept is not None:
                log.info(
                    f"pitstop: the configuration differs from the run's; the previous one is "
                    f"kept in {kept}"
                )
            write_text_atomic(out / run_record.CONFIG, saved)
            if self.geometry.measured is not None:  # before step 1: --resume reads it back
                write_run_choices(out, self.geometry.measured)
        dist_mod.barrier(self.env)  # rank 0 has cleared/created what the others will write to

    def _identity(self) -> dict[str, Any]:
        return resume_mod.identity(
            self.cfg, data_key=self.data_key, max_seq_len=self.geometry.max_seq_len,
            tokens_per_step=self.geometry.tokens_per_step, total_steps=self.total_steps,
            warmup_steps=self.warmup,
        )  # fmt: skip

    def _restore(self, path: Path) -> None:
        st = ckpt.read_checkpoint(path)
        changed = resume_mod.check_same_run(
            st["trainer_state"].get("identity"), self._identity(),
            allow=self.cfg.resume_with_changes, path=path,
        )  # fmt: skip
        if changed and self.is_main:
            log.warning(
                "pitstop: warning: --resume-with-changes: continuing with changed settings: "
                + "; ".join(changed)
            )
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
        self.state = RunState.from_trainer_state(st["trainer_state"])
        self._last_ckpt_step = self.state.step
        self._bad_run_t.fill_(self.state.bad_run)
        self._skipped_t.fill_(self.state.skipped_steps)
        self.resumed_from = str(path)
        self.writer.last_written = path

    # --- phases ---------------------------------------------------------------------

    def fetch_batch(self) -> dict[str, Any]:
        return next(self._batches)

    def to_device(self, mb: dict[str, Any]) -> dict[str, Any]:
        return to_device(mb, self.device, self.choices["attention"].value)

    def _loss(self, batch: dict[str, Any], model: Any = None) -> torch.Tensor:
        """Sum of token cross-entropies over the targets of a micro-batch (fp32 scalar).

        `model`: call this module instead of the training forward (evaluation).
        """
        forward = model if model is not None else self._forward
        return token_loss_sum(forward, batch, self.device.type, self.autocast_dtype)

    def _nan_loss(self, batch: dict[str, Any]) -> torch.Tensor:
        """Test hook (PITSTOP_TEST_NAN_STEPS=3,4): poison the loss of those steps (1-based)."""
        loss = self._loss(batch)
        if self.state.step + 1 in self._nan_steps:
            loss = loss * float("nan")
        return loss

    def _forward(self, **kwargs: Any) -> Any:
        if not self._compiled:
            return self.forward_model(**kwargs)
        try:
            return self.forward_model(**kwargs)
        except Exception as e:  # --compile on must never crash the run
            log.warning(
                f"pitstop: warning: torch.compile failed ({type(e).__name__}: {e}); "
                "continuing without compile"
            )
            self.forward_model, self._compiled = self.model, False
            self.choices["compile"] = Choice(False, f"compile failed ({type(e).__name__}); eager")
            return self.forward_model(**kwargs)

    def forward_backward(
        self, batch: dict[str, Any], step_targets: int, tl: Timeline, *, last: bool = True
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
        lr = lr_at(self.state.step, peak_lr=self.cfg.lr, total_steps=self.total_steps,
                   warmup_steps=self.warmup, schedule=self.cfg.schedule,
                   min_lr_ratio=self.cfg.min_lr_ratio)  # fmt: skip
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        if self._ckpt_copy is not None:
            # A checkpoint's device-to-host copy may still be reading the weights and the
            # optimizer state: the update waits for it on the device (the host does not).
            torch.cuda.current_stream(self.device).wait_event(self._ckpt_copy)
            self._ckpt_copy = None
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
        """Train; OUT_DIR is locked against a second writer for the whole run (pitstop/runlock.py)."""
        held = run_lock.acquire(self.out) if self.is_main else None
        try:
            return self._fit()
        finally:
            if held is not None:
                held.release()

    def _fit(self) -> dict[str, Any]:
        self._prepare_output()
        self.run_log = RunLog(
            self.cfg, self.out, enabled=self.is_main, total_steps=self.total_steps
        )
        self.choices.update(self.run_log.choices)
        if self.is_main:
            print_banner(self._banner())
        self._batches = iter(self.loader)
        old_handlers = self._install_signals()
        self.run_log.start_progress(self.state.step)
        tl = Timeline(use_cuda_events=self.device.type == "cuda")
        last_save_time = time.monotonic()
        t_train0 = time.perf_counter()
        status = "failed"
        ok = False
        try:
            tl.start_step()
            while self.state.step < self.total_steps:
                halved = None
                try:
                    self._train_step(tl)
                except (RuntimeError, MemoryError) as e:
                    if not oom.is_oom(e):
                        raise
                    halved = self._halved_split(e)
                    if halved is None:
                        raise self._out_of_memory(e) from None
                if halved is not None:  # outside `except`: its frames hold the step's tensors
                    self._back_off(*halved)
                    continue  # the same step again, from its first micro-batch
                rec = tl.end_step()
                tl.start_step()  # logging, eval and checkpoint below count toward the next step
                self._pending[-1]["record"] = rec
                self.run_log.step_done()
                done = self.state.step >= self.total_steps
                save_due = bool(self.cfg.save_steps and self.state.step % self.cfg.save_steps == 0)
                log_due = self.state.step % self.cfg.log_steps == 0 or done
                time_due = (
                    self.cfg.save_minutes is not None
                    and time.monotonic() - last_save_time >= 60 * self.cfg.save_minutes
                )
                signalled = self._stop_signal is not None
                if self.env.distributed:  # ranks act on these together, at logging steps only
                    time_due, signalled = self._agree(time_due, signalled, now=log_due or save_due)
                save_due = save_due or time_due
                stop = signalled or self.state.step == self._stop_at
                self.train_seconds_now = self.state.train_seconds + time.perf_counter() - t_train0
                eval_due = self._eval_due(done)
                if eval_due:  # before logging: the result goes on this step's metrics line
                    with tl.phase("eval"):
                        self.evaluate()
                if log_due or save_due or stop or eval_due:
                    with tl.phase("logging"):
                        self.log(progress=True)
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
        except KeyboardInterrupt:  # a second Ctrl-C: stopped at once, without a save
            status = "interrupted"
            raise
        finally:
            self.run_log.stop_progress()
            self._restore_signals(old_handlers)
            train_end = time.perf_counter()
            leftover = tl.end_step()  # time after the last step (its logging): counted too
            for k, v in leftover.resolve().items():
                if k != "other":
                    self.state.phase_totals[k] += v
            self.state.train_seconds += train_end - t_train0
            if not ok:
                self._finish_quietly(status)
        status = "completed"
        try:
            self._final_save(t_train0)
        except BaseException as e:  # the end could not be saved: no final/, and say so
            self._finish_quietly("interrupted" if isinstance(e, KeyboardInterrupt) else "failed")
            raise
        summary = self.summary(status)
        if self.is_main:
            write_summary(self.out, summary)
            log.info(result_line(summary))
        self.run_log.close()
        # Ranks leave together: a rank that tears down gloo while rank 0 still writes the
        # final model was seen to abort ("terminate called without an active exception").
        dist_mod.barrier(self.env)
        return summary.to_json()

    def _out_of_memory(self, e: BaseException) -> oom.TrainingOutOfMemory:
        try:  # a checkpoint on its way to disk: let it land before naming it
            self.writer.wait()
        except ckpt.CheckpointError as err:
            log.warning(f"pitstop: {err}")
        gc = bool(self.cfg.gradient_checkpointing)
        return oom.oom_error(
            e,
            step=self.state.step + 1,
            micro=getattr(self, "_micro", None),
            device_type=self.device.type,
            last_checkpoint=self.writer.last_written,
            model_dir=str(self.cfg.model),
            seq_len=self.geometry.max_seq_len,
            precision=self.precision,
            attention=str(self.choices["attention"].value),
            checkpointing=gc,
            lora_r=self.cfg.lora_r,
        )

    def _halved_split(self, e: BaseException) -> tuple[Any, str] | None:
        """(the loader's settings with half the micro-batch, a description), or None when
        backing off cannot be done safely: not a CUDA OOM in a forward/backward, several
        processes (the other ranks would wait in a collective), a loader that cannot
        re-split, or a micro-batch of one row already."""
        cuda_oom = oom.is_cuda_oom(e)
        settings = getattr(self.loader, "settings", None)
        if not (cuda_oom and self._oom_retryable and self.world_size == 1) or settings is None:
            return None
        if not hasattr(self.loader, "resplit"):
            return None
        msl = settings.max_seq_len
        if settings.micro_batch_size is not None:
            if settings.micro_batch_size <= 1:
                return None
            rows = settings.micro_batch_size // 2
            return dataclasses.replace(settings, micro_batch_size=rows), f"{rows} rows"
        budget = settings.tokens_per_micro_batch or msl
        if budget // 2 < msl:
            return None
        half = budget // 2 // msl * msl  # whole rows of max_seq_len
        return dataclasses.replace(settings, tokens_per_micro_batch=half), f"{half // msl} rows"

    def _back_off(self, settings: Any, rows: str) -> None:
        """After a CUDA out-of-memory in step N: drop its partial gradients, split the steps
        into micro-batches half as large, and run step N again. The step's documents, and so
        the training math, stay the same (only the summation order changes)."""
        step = self.state.step + 1
        self.optimizer.zero_grad(set_to_none=True)
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()
        self.loader.resplit(settings)
        self._batches = iter(self.loader)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        was = self.choices.get("micro_batch")
        before = f"{was.value}; " if was is not None else ""
        self.choices["micro_batch"] = Choice(
            rows, f"{before}backed off to half after a CUDA out-of-memory in step {step}; "
            "tokens per optimizer step unchanged",
        )  # fmt: skip
        if self.is_main:
            log.warning(
                f"pitstop: warning: CUDA out of memory in step {step}: continuing with "
                f"micro-batches of {rows} (same step, same tokens); set --micro-batch-size "
                "or rerun with --remeasure to size it again"
            )

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
        meta: MicroBatchMeta | None = None
        micro_count = 1
        m = 0
        while m < micro_count:
            with tl.phase("data_wait"):
                mb = self.fetch_batch()
                if m == 0 and self.hooks.step_started():
                    # The loop ends after this step (total_steps is re-read every step);
                    # the LR schedule does not matter for a measurement.
                    self.total_steps = self.state.step + 1
            meta = mb["meta"]
            micro_count = meta.micro_count
            with tl.phase("host_to_device"):
                batch = self.to_device(mb)
            last = m == micro_count - 1
            self._micro = (m, micro_count, tuple(batch["input_ids"].shape))  # for an OOM message
            self._oom_retryable = True
            hook = self._oom_rows
            if hook and hook[0] == self.state.step + 1 and batch["input_ids"].shape[0] > hook[1]:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (PITSTOP_TEST_OOM_ROWS)")
            loss_acc += self.forward_backward(batch, meta.step_targets, tl, last=last)
            self._oom_retryable = False
            n_targets += meta.n_targets
            n_seen += meta.n_seen
            n_pos += meta.n_positions
            m += 1
        with tl.phase("optimizer"):
            norm, bad, lr = self.optimizer_step(loss_acc)
            weights_bad = guard.nonfinite_weights(self.params)  # on device: read by log()
            self.hooks.step_ended(self.state.step)
        self.state.step += 1
        # The fraction of the *current* epoch: meta.step counts from the start of the run.
        assert meta is not None  # a step has at least one micro-batch
        epoch = meta.epoch
        if meta.epoch_step is not None:
            in_epoch = meta.epoch_step
        else:  # a caller's loader without it: epochs of steps_per_epoch steps each
            in_epoch = meta.step - epoch * self.steps_per_epoch
        self.state.epoch_float = epoch + (in_epoch + 1) / self._steps_in_epoch(epoch)
        # Device-side bad-step bookkeeping: read only at logging steps.
        self._bad_run_t = (self._bad_run_t + 1) * bad
        self._skipped_t = self._skipped_t + bad
        # Token counts are this rank's; log() sums them over ranks with the loss.
        self._pending.append({
            "step": self.state.step, "epoch": round(self.state.epoch_float, 6), "loss": loss_acc, "lr": lr,
            "grad_norm": norm, "bad": bad, "counts": (n_targets, n_seen, n_pos),
            "bad_run": self._bad_run_t, "weights_bad": weights_bad,
        })  # fmt: skip

    def _steps_in_epoch(self, epoch: int) -> int:
        """Steps of `epoch` (bucket and pad plans may differ by a step between epochs)."""
        fn = getattr(self.loader, "steps_in_epoch", None)
        return int(fn(epoch)) if fn is not None else self.steps_per_epoch

    def log(self, progress: bool = False) -> None:
        """The logging step: the one place the loop reads device values (a sync).

        `progress`: also show the newest line on the progress bar (the loop's logging
        steps; a checkpoint's flush of the pending lines does not).
        """
        if not self._pending:
            return
        lines = self._account(self._pending_values())
        if lines:  # the process's peak so far (CUDA: tensors; CPU: resident set)
            lines[-1]["peak_memory_gib"] = peak_memory_bytes(self.device.type) / 2**30
        self.run_log.write(
            lines,
            trained_tokens=self.state.trained_tokens,
            train_seconds=self.train_seconds_now,
            progress=progress,
        )

    def _pending_values(self) -> list[list[float]]:
        """Per pending step: loss share, targets, seen, positions, ranks whose weights went
        non-finite (summed over ranks), then grad norm, bad, bad run (the same on every
        rank). One collective, one transfer."""
        # float64 so the counts stay exact
        summed = torch.stack([
            torch.cat([p["loss"].double().reshape(1),
                       torch.tensor(p["counts"], dtype=torch.float64).to(self.device),
                       p["weights_bad"].double().reshape(1).to(self.device)])
            for p in self._pending
        ])  # fmt: skip
        dist_mod.all_reduce_sum(summed, self.env)
        same = torch.stack([
            torch.stack([p["grad_norm"].double(), p["bad"].double(), p["bad_run"].double()])
            for p in self._pending
        ])  # fmt: skip
        return torch.cat([summed, same], dim=1).tolist()

    def _account(self, vals: list[list[float]]) -> list[dict[str, Any]]:
        """Count the pending steps into the run state; their metrics.jsonl lines.

        Raises TrainingDiverged (after writing the lines) at cfg.max_bad_steps bad steps in a row.
        """
        lines = []
        for p, (loss, n_t, n_s, n_p, w_bad, norm, bad, bad_run) in zip(self._pending, vals):
            rec: StepRecord = p.pop("record")
            phases = rec.resolve()
            for k, v in phases.items():
                self.state.phase_totals[k] += v
            skipped = bool(bad)
            self.state.trained_tokens += int(n_t)
            self.state.seen_tokens += int(n_s)
            self.state.padded_tokens += int(n_p)
            drop = ("loss", "grad_norm", "bad", "bad_run", "counts", "weights_bad")
            line = {k: v for k, v in p.items() if k not in drop}
            line.update({
                "loss": None if skipped else loss, "grad_norm": norm, "skipped": skipped,
                "trained_tokens": self.state.trained_tokens, "seen_tokens": self.state.seen_tokens,
                "padded_tokens": self.state.padded_tokens, "step_trained_tokens": int(n_t),
                "tokens_per_second": int(n_t) / rec.step_seconds if rec.step_seconds > 0 else None,
                "step_seconds": rec.step_seconds,
                # of the positions computed (padding included), as the summary's MFU
                "mfu": flops_mod.mfu(n_p / rec.step_seconds, self.flops_per_token, self.peak_flops)
                if rec.step_seconds > 0 else None,
                **{f"{k}_s": v for k, v in phases.items()},
            })  # fmt: skip
            lines.append(line)
            if w_bad:  # this update broke the weights: stop before anything saves them
                line["weights_finite"] = False
                self._pending = []
                self.run_log.append_metrics(lines)
                self._diverged(p["step"], p["lr"], loss, norm, weights=True)
            if skipped:
                self.state.skipped_steps += 1
                self.state.bad_run = int(bad_run)
                if self.state.bad_run >= self.cfg.max_bad_steps:
                    self._pending = []
                    self.run_log.append_metrics(lines)
                    self._diverged(p["step"], p["lr"], loss, norm)
            else:
                self.state.bad_run = 0
                self.state.last_loss, self.state.last_loss_step = loss, p["step"]
        self._pending = []
        return lines

    def _diverged(
        self, step: int, lr: float, loss: float, norm: float, *, weights: bool = False
    ) -> None:
        # A checkpoint may still be on its way to disk: let it land before naming it.
        self.writer.wait()
        last = self.writer.last_written
        what = (
            f"the update of optimizer step {step} made weights non-finite (NaN/Inf; loss "
            f"{loss}, gradient norm {norm}, learning rate {lr:.3g}); they were not saved"
            if weights
            else f"{self.state.bad_run} optimizer steps in a row had a non-finite loss or gradient "
            f"(loss {loss}, gradient norm {norm}, learning rate {lr:.3g}); those steps were skipped"
        )
        raise TrainingDiverged(
            f"training stopped at step {step}: {what}. The last good checkpoint is "
            f"{last or 'none (no checkpoint yet)'}. "
            + guard.divergence_advice(self.precision, self.cfg.max_grad_norm)
        )

    def _eval_due(self, done: bool) -> bool:
        if self.eval_set is None:
            return False
        every = self.cfg.eval_steps
        return done or bool(every and self.state.step % every == 0)

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
        res = self.eval_set.result(float(total.item()), self.state.step, time.perf_counter() - t0)
        self.state.last_eval = res
        if self._pending and self._pending[-1]["step"] == self.state.step:
            self._pending[-1].update({k: v for k, v in res.items() if k != "step"})
        return res

    # --- checkpoints ----------------------------------------------------------------

    def _trainer_state(self, t_train0: float) -> dict[str, Any]:
        ts = self.state.to_trainer_state(
            total_steps=self.total_steps,
            train_seconds=self.state.train_seconds + time.perf_counter() - t_train0,
            wall_seconds=self.state.wall_before + time.time() - self.t_process,
        )
        ts["identity"] = self._identity()  # what --resume checks (train/resume.py)
        return ts

    def checkpoint(self, t_train0: float, *, blocking: bool = False) -> None:
        """Pause only to copy state to host memory; the writer thread does the rest."""
        t0 = time.perf_counter()
        self.log()  # lines up to this step must exist before the checkpoint does
        self._last_ckpt_step = self.state.step
        if self.fsdp:
            # Collective: every rank sends its shards; rank 0 gets full CPU copies.
            model_state = dist_mod.full_state(self.model)
            optim_state = dist_mod.full_optimizer_state(self.model, self.optimizer)
        if not self.is_main:  # DDP: rank 0's replica is the same as this one
            self.state.ckpt_pause += time.perf_counter() - t0
            return
        scaler = self.scaler.state_dict() if self.scaler is not None else None
        ready = None
        if self.fsdp:
            self.writer.wait()  # the previous write must be done (and must have succeeded)
            scaler = ckpt.to_host(scaler)
        else:
            # Waits for the previous write, then queues the copy into the reused host
            # buffers (a side CUDA stream on a GPU): the loop goes on at once, and the
            # next optimizer step waits on `ready` before changing what is being copied.
            (model_state, optim_state, scaler), ready = self.writer.stage(
                (model_io.trainable_state(self.model), self.optimizer.state_dict(), scaler)
            )
            self._ckpt_copy = ready
        snap = ckpt.Snapshot(
            step=self.state.step,
            model_state=model_state,
            optimizer={"optimizer": optim_state, "scaler": scaler},
            trainer_state=self._trainer_state(t_train0),
            rng=ckpt.rng_state(),
            loader_state=self.loader.state_dict(),
            ready=ready,
        )
        self.writer.submit(snap, blocking=blocking)
        self.state.ckpt_pause += time.perf_counter() - t0

    def _final_save(self, t_train0: float) -> None:
        """A last checkpoint (unless this step has one) and final/ (HF-loadable)."""
        if not self.save_final:
            self.writer.wait()  # no final model; still let async checkpoint writes finish
            return
        if self._last_ckpt_step != self.state.step:
            self.checkpoint(t_train0)  # on every rank: FSDP gathers the state collectively
        t0 = time.perf_counter()
        state = dist_mod.full_state(self.model) if self.fsdp else None
        if not self.is_main:
            return
        tmp = self.out / f".final.partial-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            model_io.save_final(self.model, self.tokenizer, tmp, state, self.cfg)
            # The last checkpoint must have landed (and its weights been finite) first:
            # final/ is never published by a run that could not save its end.
            self.writer.wait()
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        model_io.publish_dir(tmp, self.out / run_record.FINAL)
        if self.cfg.merge_lora and model_io.is_peft(self.model):
            from pitstop.train.export import merge_adapter  # loads a second copy of the base

            merge_adapter(self.out / run_record.FINAL, self.out / run_record.MERGED)
        self.final_save_seconds = time.perf_counter() - t0

    def _finish_quietly(self, status: str) -> None:
        """On a stop: let the checkpoint writer finish, record the summary, keep the error."""
        try:
            self.writer.wait()
        except ckpt.CheckpointError as e:
            log.warning(f"pitstop: {e}")
        if self.is_main:
            write_summary(self.out, self.summary(status))
        self.run_log.close()

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
        log.info(
            f"\npitstop: {signal.Signals(signum).name} received: finishing step {self.state.step + 1}, "
            "then saving a checkpoint (Ctrl-C again to stop at once)"
        )

    def _restore_signals(self, old: dict[int, Any]) -> None:
        for sig, h in old.items():
            signal.signal(sig, h)

    def _interrupted(self) -> RunInterrupted:
        signum = self._stop_signal or signal.SIGTERM
        cmd = f"pitstop train --config {self.out / run_record.CONFIG} --resume"
        return RunInterrupted(
            f"stopped by {signal.Signals(signum).name} after step {self.state.step} of {self.total_steps}; "
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

    def summary(self, status: str) -> RunSummary:
        """The run's summary.json so far (built in pitstop.train.summary)."""
        return trainer_summary(
            status, state=self.state, total_steps=self.total_steps, world_size=self.world_size,
            device=self.dev, device_type=self.device.type, choices=self.choices,
            measured=self.geometry.measured, planned_efficiency=self.geometry.efficiency,
            flops_per_token=self.flops_per_token, peak_flops=self.peak_flops,
            peak_source=self.peak_source, checkpoints=self.writer, t_process=self.t_process,
            out=self.out, config=self.cfg.to_dict(), resumed_from=self.resumed_from,
        )  # fmt: skip
