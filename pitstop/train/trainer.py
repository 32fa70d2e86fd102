"""The training loop as an object with named phases (torchtitan style).

`Trainer.fit()` runs optimizer steps, each made of the phases the step timeline
times: fetch_batch (data_wait), to_device (host_to_device), forward_backward
(forward, backward) per micro-batch, optimizer_step (optimizer); then, charged to
the next step, what train/cadence.py says is due: log (logging), evaluate (eval),
checkpoint (checkpoint). The hot loop never synchronises host and device except at
logging steps, at checkpoints (a copy to host is a sync anyway), on fp16 runs inside
GradScaler.step, and with a bitsandbytes 8-bit optimizer on a GPU once per step (its
kernels take no device-side skip flag, so skipping a non-finite step reads the flag;
tests/test_step_syncs.py keeps this list honest). transformers itself reads one flag per
forward to detect packed rows (masking_utils.find_packed_sequence_indices). Losses and
norms stay device tensors until their metrics.jsonl lines are written (train/pending.py). Several processes: rank 0 alone prints, logs
and writes; the ranks agree on stopping and timed saves at logging steps
(train/distributed.py, train/cadence.py). Set-up of the run directory:
train/run_dir.py; signals: train/signals.py; out of memory: train/oom.py.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import torch

from pitstop.batching.loader import Loader
from pitstop.batching.records import MicroBatch, MicroBatchMeta
from pitstop.core import host_malloc, log, runlock
from pitstop.core.config import RunConfig
from pitstop.core.run_record import RunSummary, write_summary
from pitstop.measure.memory import peak_memory
from pitstop.measure.timeline import Timeline
from pitstop.probe import Choice, DeviceInfo
from pitstop.train import checkpoint, distributed, guard, model_io, oom, pending, run_dir
from pitstop.train.banner import print_banner, run_banner
from pitstop.train.build import Run, build_run
from pitstop.train.cadence import Cadence
from pitstop.train.compile import GuardedForward
from pitstop.train.compile_record import LATER_EVERY, LATER_PAIRS
from pitstop.train.evaluate import EvalResult, held_out_loss
from pitstop.train.export import write_final
from pitstop.train.forward import DeviceBatch, to_device, token_loss_sum
from pitstop.train.guard import TrainingDiverged
from pitstop.train.hooks import NoHooks, StepHooks
from pitstop.train.pending import PendingStep
from pitstop.train.run_log import RunLog
from pitstop.train.schedule import lr_at
from pitstop.train.signals import RunInterrupted, StopSignals, interrupted
from pitstop.train.state import RunState
from pitstop.train.summary import result_line, trainer_summary

__all__ = ["RunInterrupted", "Trainer", "TrainingDiverged"]


class Trainer:
    """One training run's loop. `fit()` returns the run's `RunSummary`.

    It receives what `pitstop.train.build.build_run` assembled (`Trainer(run)`);
    `Trainer.from_config(cfg, ...)` builds that first. The run's parts are read as
    `trainer.run.X`. `hooks` are called at each step's start and end (train/hooks.py);
    `save_final=False` skips final/ (a measurement run: writing it can take minutes for a
    large model).
    """

    def __init__(
        self, run: Run, *, hooks: StepHooks | None = None, save_final: bool = True
    ) -> None:
        self.run = run
        self.hooks: StepHooks = hooks if hooks is not None else NoHooks()
        self.save_final = save_final  # False: a measurement run keeps no final model
        self.is_main, self.world_size = run.env.rank == 0, run.env.world_size
        agree = partial(distributed.any_rank, device=run.device) if run.env.distributed else None
        self.cadence = Cadence(
            run.cfg,
            total_steps=run.total_steps,
            has_eval=run.eval_set is not None,
            faults=run.faults,
            agree=agree,
        )
        # --compile on falls back to the wrapped module (DDP/FSDP), never the bare model;
        # the ranks agree on it at logging steps (train/cadence.py).
        self._guard = GuardedForward(run.wrapped, run.forward_model if run.compiled else None)
        self.cadence.compile_failed_here = lambda: self._guard.failed
        if hooks is not None:
            # A measurement (pitstop profile, tune's trials) times its own steps, compile's
            # first one included: compiled from its first step, nothing measured here.
            run.compile_timing = None

        # --- the run's state (a resumed run restores it: the summary counts the whole run)
        self.state = RunState()
        self._last_ckpt_step: int | None = None  # on every rank (the writer lives on rank 0)
        self._ckpt_copy: Any = None  # the CUDA event of a checkpoint copy still in flight
        # FSDP: (step, weights) gathered by the last step's checkpoint, for final/ to reuse.
        self._final_state: tuple[int, dict[str, torch.Tensor]] | None = None
        self.resumed_from: str | None = None
        self._bad_run_t = torch.zeros((), device=run.device)
        self._pending: list[PendingStep] = []
        self.train_seconds_now = 0.0
        self._faults_from: tuple[int, int] | None = None  # (step, minor faults) after step 1
        self._micro: tuple[int, int, tuple[int, ...]] | None = None  # for an OOM message
        self._oom_retryable = False  # the OOM came from a forward/backward (a backoff may help)
        self._compile_choice: Choice | None = None  # before compile's measurements joined it

    @classmethod
    def from_config(
        cls,
        cfg: RunConfig,
        *,
        device: DeviceInfo | None = None,
        loader: Loader | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        hooks: StepHooks | None = None,
        save_final: bool = True,
    ) -> Trainer:
        """`build_run(cfg, ...)`, then the Trainer of it. `device` overrides the probe (tests
        pretend machines with it); `loader` replaces the batching loader (any object
        honouring `pitstop.batching.loader.Loader`)."""
        run = build_run(cfg, device=device, loader=loader, rank=rank, world_size=world_size)
        return cls(run, hooks=hooks, save_final=save_final)

    @property
    def total_steps(self) -> int:
        """The run's last step: the plan's, or sooner when a hook asked (train/cadence.py)."""
        return self.cadence.last_step

    # --- phases ---------------------------------------------------------------------

    def fetch_batch(self) -> MicroBatch:
        return next(self._batches)

    def to_device(self, mb: MicroBatch) -> DeviceBatch:
        # A compiled forward marks its inputs' dynamic sizes itself (train/compile.py).
        return to_device(mb, self.run.device, self.run.choices["attention"].value)

    def _loss(self, batch: DeviceBatch, model: Any = None) -> torch.Tensor:
        """Sum of token cross-entropies over the targets of a micro-batch (fp32 scalar).

        `model`: call this module instead of the training forward (evaluation).
        """
        forward = model if model is not None else self._forward
        return token_loss_sum(forward, batch, self.run.device.type, self.run.autocast_dtype)

    def _forward(self, **kwargs: Any) -> Any:
        timing = self.run.compile_timing
        if timing is not None and timing.eager_now():  # compile's cost and gain measured
            return self._guard.eager(**kwargs)  # the same math (train/compile_record.py)
        out = self._guard(**kwargs)
        if self.run.compiled and not self._guard.active:  # this rank fell back (train/compile.py)
            self._compile_fell_back()
        return out

    def _compile_fell_back(self) -> None:
        self.run.forward_model, self.run.compiled = self._guard.to_eager(self.run.choices)

    def forward_backward(
        self, batch: DeviceBatch, step_targets: int, tl: Timeline, *, last: bool = True
    ) -> torch.Tensor:
        """One micro-batch; returns its share of the step's loss (sum CE / step targets).

        `last`: the step's last micro-batch on this rank, the one whose backward
        all-reduces DDP's gradients (no_sync before it). FSDP2 reduce-scatters after
        every micro-batch (distributed.no_sync says why).
        """
        run = self.run
        with distributed.no_sync(run.wrapped, run.cfg.strategy, last):
            with tl.phase("forward"):
                loss = self._loss(batch)
                if run.faults.poisons(self.state.step + 1):  # a test's NaN step
                    loss = loss * float("nan")
                loss = loss / max(step_targets, 1)
            # DDP/FSDP average gradients over ranks; the step's gradient is their sum.
            scaled = loss * self.world_size if self.world_size > 1 else loss
            with tl.phase("backward"):
                (run.scaler.scale(scaled) if run.scaler is not None else scaled).backward()
        return loss.detach()

    def optimizer_step(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Clip, skip if non-finite, step. Returns (grad norm, skipped flag tensor, lr)."""
        run, cfg = self.run, self.run.cfg
        lr = lr_at(
            self.state.step,
            peak_lr=cfg.lr,
            total_steps=self.total_steps,
            warmup_steps=run.warmup,
            schedule=cfg.schedule,
            min_lr_ratio=cfg.min_lr_ratio,
        )
        for g in run.optimizer.param_groups:
            g["lr"] = lr
        if self._ckpt_copy is not None:
            # A checkpoint's device-to-host copy may still be reading the weights and the
            # optimizer state: the update waits for it on the device (the host does not).
            torch.cuda.current_stream(run.device).wait_event(self._ckpt_copy)
            self._ckpt_copy = None
        if run.scaler is not None:
            run.scaler.unscale_(run.optimizer)
        if cfg.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(run.params, cfg.max_grad_norm, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in run.params if p.grad is not None])
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
            norm = norm.full_tensor()
        if run.env.distributed:
            # The norm is the same on every rank (reduced gradients); the local loss is not,
            # and ranks must agree on skipping. A non-finite loss makes non-finite gradients.
            bad = ~torch.isfinite(norm)
        else:
            bad = ~(torch.isfinite(norm) & torch.isfinite(loss))  # 0-dim bool on the device
        if run.sync_free_skip:
            run.optimizer.found_inf = bad.float()  # the fused kernel skips the update itself
            run.optimizer.step()
            run.optimizer.found_inf = None
        elif run.scaler is not None:
            run.scaler.step(run.optimizer)  # syncs internally; skips inf grads (loss scale)
            run.scaler.update()
        elif not bool(bad):  # CPU: no device sync; a GPU's 8-bit optimizer: the one per step
            run.optimizer.step()
        distributed.zero_grad(run.optimizer, run.wrapped)  # DDP: in place (bucket views)
        return norm.detach(), bad, lr

    # --- the loop -----------------------------------------------------------------

    def fit(self) -> RunSummary:
        """Train and return the run's summary (also written to OUT_DIR/summary.json, on
        rank 0); OUT_DIR is locked against a second writer for the whole run (pitstop/core/runlock.py)."""
        held = runlock.acquire(self.run.out) if self.is_main else None
        try:
            return self._fit()
        finally:
            if held is not None:
                held.release()

    def _start(self) -> None:
        """The run directory (restored on --resume), the log, the banner, the batches."""
        run = self.run
        restored = run_dir.prepare_output(run, total_steps=self.total_steps)
        if restored is not None:
            self.state = restored.state
            self._last_ckpt_step = self.state.step
            self._bad_run_t.fill_(self.state.bad_run)
            self.resumed_from = str(restored.path)
        self.run_log = RunLog(run.cfg, run.out, enabled=self.is_main, total_steps=self.total_steps)
        run.choices.update(self.run_log.choices)
        if self.is_main:
            print_banner(
                run_banner(run, total_steps=self.total_steps, resumed_from=self.resumed_from)
            )
        self._batches = iter(run.loader)

    def _fit(self) -> RunSummary:
        self._start()
        self.run_log.start_progress(self.state.step)
        tl = Timeline(use_cuda_events=self.run.device.type == "cuda")
        t_train0 = time.perf_counter()
        status = "failed"
        ok = False
        try:
            with StopSignals(
                self.cadence, announce=self.is_main, next_step=lambda: self.state.step + 1
            ):
                self._loop(tl, t_train0)
            ok = True
        except (TrainingDiverged, RunInterrupted) as e:
            status = "diverged" if isinstance(e, TrainingDiverged) else "interrupted"
            raise
        except KeyboardInterrupt:  # a second Ctrl-C: stopped at once, without a save
            status = "interrupted"
            raise
        finally:
            self.run_log.stop_progress()
            train_end = time.perf_counter()
            leftover, lost = tl.end_step_seconds()  # after the last step (its logging): counted
            if lost:
                log.warning(f"pitstop: warning: the interrupted step's timing is lost ({lost})")
            for k, v in leftover.items():
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
            write_summary(self.run.out, summary)
            log.info(result_line(summary))
        self.run_log.close()
        # Ranks leave together: a rank that tears down gloo while rank 0 still writes the
        # final model was seen to abort ("terminate called without an active exception").
        distributed.barrier(self.run.env)
        return summary

    def _loop(self, tl: Timeline, t_train0: float) -> None:
        """Steps until the cadence says the run is done; raises RunInterrupted on a signal."""
        tl.start_step()
        while self.cadence.running(self.state.step):
            t_step = time.perf_counter()
            if not self._step_or_back_off(tl):
                continue  # the same step again, from its first micro-batch
            if self.run.compile_timing is not None:
                self._time_compile(t_step)
            rec = tl.end_step()
            if self._faults_from is None:
                self._faults_from = (self.state.step, host_malloc.minor_faults())
            tl.start_step()  # logging, eval and checkpoint below count toward the next step
            self._pending[-1].record = rec
            self.run_log.step_done()
            due = self.cadence.due(self.state.step)
            if due.compile_failed and self.run.compiled:  # one rank's compile failed: all eager
                self._compile_fell_back()
            self.train_seconds_now = self.state.train_seconds + time.perf_counter() - t_train0
            if due.eval:  # before logging: the result goes on this step's metrics line
                with tl.phase("eval"):
                    self.evaluate()
            if due.log:
                with tl.phase("logging"):
                    self.log(progress=True)
            if due.save:
                with tl.phase("checkpoint"):
                    self.checkpoint(t_train0)
                self.cadence.saved()
            if due.stop:
                self.run.writer.wait()
                raise interrupted(
                    self.cadence.signal,
                    out=self.run.out,
                    step=self.state.step,
                    total_steps=self.total_steps,
                    checkpoint=self.run.writer.last_written,
                )

    def _time_compile(self, t_step: float) -> None:
        """Feed the step's seconds to the compile timing; once it has measured compile's
        cost and gain (train/compile_record.py), record them in the compile choice."""
        run = self.run
        timing = run.compile_timing
        assert timing is not None
        if not run.compiled:  # the compile failed and this run went eager: nothing to time
            run.compile_timing = None
            return
        if timing.clock_now():
            timing.sync()  # a GPU's clock must cover the step's device work (these steps only)
        speed = timing.step_done(time.perf_counter() - t_step)
        if timing.done():
            run.compile_timing = None
        if speed is None:
            return
        first = self._compile_choice is None
        if first:
            self._compile_choice = run.choices["compile"]
        before = self._compile_choice
        run.choices["compile"] = Choice(
            True,
            f"{before.reason}; {speed.describe()}",
            {**(before.measured or {}), "measured": speed.to_dict()},
        )
        if self.is_main and first:
            log.info(
                f"pitstop: compile {speed.describe()}; kept for this configuration's next "
                "run (compile: auto decides with it), and measured again every "
                f"{LATER_EVERY} steps up to {LATER_PAIRS} times (two eager steps, the "
                "second timed)"
            )

    def _step_or_back_off(self, tl: Timeline) -> bool:
        """One optimizer step; False when a CUDA out-of-memory made the loader re-split
        and the step must run again (train/oom.py). Other out-of-memory errors stop the run."""
        run, step = self.run, self.state.step + 1
        retry = oom.run_step(
            lambda: self._train_step(tl),
            run,
            step=step,
            retryable=lambda: self._oom_retryable,
            micro=lambda: self._micro,
        )
        if retry is not None:
            self._batches = oom.back_off(
                run.loader,
                self._batches,
                *retry,
                step=step,
                choices=run.choices,
                device_type=run.device.type,
                announce=self.is_main,
            )
        return retry is None

    def close(self) -> None:
        """Leave the process group (torchrun runs); safe to call more than once."""
        distributed.shutdown(self.run.env)

    def _train_step(self, tl: Timeline) -> None:
        run = self.run
        loss_acc = torch.zeros((), device=run.device)
        n_targets = n_seen = n_pos = 0
        meta: MicroBatchMeta | None = None
        micro_count = 1
        m = 0
        while m < micro_count:
            with tl.phase("data_wait"):
                mb = self.fetch_batch()
                if m == 0 and self.hooks.step_started():
                    # The loop ends after this step; the LR schedule does not matter for a measurement.
                    self.cadence.stop_after(self.state.step + 1)
            meta = mb["meta"]
            micro_count = meta.micro_count
            with tl.phase("host_to_device"):
                batch = self.to_device(mb)
            last = m == micro_count - 1
            self._micro = (m, micro_count, tuple(batch["input_ids"].shape))  # for an OOM message
            self._oom_retryable = True
            if run.faults.out_of_memory(self.state.step + 1, batch["input_ids"].shape[0]):
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (a test fault)")
            loss_acc += self.forward_backward(batch, meta.step_targets, tl, last=last)
            self._oom_retryable = False
            if m == 0:
                run.faults.reached("step", self.state.step + 1)
            n_targets += meta.n_targets
            n_seen += meta.n_seen
            n_pos += meta.n_positions
            m += 1
        with tl.phase("optimizer"):
            norm, bad, lr = self.optimizer_step(loss_acc)
            weights_bad = guard.nonfinite_weights(run.params)  # on device: read by log()
            self.hooks.step_ended(self.state.step)
        self.state.step += 1
        # The fraction of the *current* epoch: meta.step counts from the start of the run.
        assert meta is not None  # a step has at least one micro-batch
        epoch = meta.epoch
        if meta.epoch_step is not None:
            in_epoch = meta.epoch_step
        else:  # a caller's loader without it: epochs of steps_per_epoch steps each
            in_epoch = meta.step - epoch * run.steps_per_epoch
        self.state.epoch_float = epoch + (in_epoch + 1) / run.loader.steps_in_epoch(epoch)
        # Device-side bad-step bookkeeping: read only at logging steps.
        self._bad_run_t = (self._bad_run_t + 1) * bad
        # Token counts are this rank's; log() sums them over ranks with the loss.
        self._pending.append(
            PendingStep(
                step=self.state.step,
                epoch=round(self.state.epoch_float, 6),
                lr=lr,
                loss=loss_acc,
                grad_norm=norm,
                bad=bad,
                bad_run=self._bad_run_t,
                weights_bad=weights_bad,
                counts=(n_targets, n_seen, n_pos),
            )
        )

    def log(self, progress: bool = False) -> None:
        """The logging step: the one place the loop reads device values (a sync).

        `progress`: also show the newest line on the progress bar (the loop's logging
        steps; a checkpoint's flush of the pending lines does not).
        """
        if not self._pending:
            return
        run = self.run
        vals = pending.device_values(self._pending, run.env, run.device)
        lines, broken = pending.account(
            self._pending,
            vals,
            self.state,
            flops_per_token=run.flops_per_token,
            peak_flops=run.peak_flops,
            max_bad_steps=run.cfg.max_bad_steps,
        )
        self._pending = []
        if broken is not None:  # the lines up to the broken step, then stop
            self.run_log.append_metrics(lines)
            run.writer.wait()  # a checkpoint on its way to disk: let it land before naming it
            raise guard.diverged(
                **vars(broken),
                bad_run=self.state.bad_run,
                last_checkpoint=run.writer.last_written,
                precision=run.precision,
                max_grad_norm=run.cfg.max_grad_norm,
            )
        if lines:  # the process's peak so far (CUDA: tensors; CPU: resident set)
            lines[-1]["peak_memory_gib"] = peak_memory(self.run.device.type) / 2**30
        self.run_log.write(
            lines,
            trained_tokens=self.state.trained_tokens,
            train_seconds=self.train_seconds_now,
            progress=progress,
        )

    def evaluate(self) -> EvalResult:
        """Held-out loss and perplexity now (train/evaluate.py), on the unwrapped model (no
        DDP hooks; FSDP2's module gathers its shards); attached to the newest pending line."""
        run = self.run
        assert run.eval_set is not None
        res = held_out_loss(
            run.eval_set,
            run.model,
            lambda mb: self._loss(self.to_device(mb), model=run.model),
            step=self.state.step,
            device=run.device,
            all_reduce=partial(distributed.all_reduce_sum, env=run.env),
        )
        self.state.last_eval = res
        if self._pending and self._pending[-1].step == self.state.step:
            self._pending[-1].eval = {k: v for k, v in res.items() if k != "step"}
        return res

    # --- checkpoints ----------------------------------------------------------------

    def checkpoint(self, t_train0: float, *, blocking: bool = False) -> None:
        """Pause only to copy state to host memory; the writer thread does the rest."""
        run, t0 = self.run, time.perf_counter()
        self.log()  # lines up to this step must exist before the checkpoint does
        self._last_ckpt_step = self.state.step
        if run.fsdp:
            if self.is_main:  # the previous write first: rank 0 never holds two full copies
                run.writer.wait()
            # Collective: every rank sends its shards; rank 0 gets full CPU copies.
            model_state = distributed.full_state(run.model)
            optim_state = distributed.full_optimizer_state(run.model, run.optimizer)
            # The last step's weights are also final/'s: kept so that the end of the run
            # does not gather a second full copy while the writer still holds this one.
            # A shallow copy: save_pretrained may drop tied keys from the dict it is given.
            last = self.state.step >= self.total_steps
            self._final_state = (self.state.step, dict(model_state)) if last else None
        if not self.is_main:  # DDP: rank 0's replica is the same as this one
            self.state.ckpt_pause += time.perf_counter() - t0
            return
        scaler = run.scaler.state_dict() if run.scaler is not None else None
        ready = None
        if run.fsdp:  # the previous write was waited for before the gather
            scaler = checkpoint.to_host(scaler)
        else:
            # Waits for the previous write, then queues the copy into the reused host
            # buffers (a side CUDA stream on a GPU): the loop goes on at once, and the
            # next optimizer step waits on `ready` before changing what is being copied.
            (model_state, optim_state, scaler), ready = run.writer.stage(
                (model_io.trainable_state(run.model), run.optimizer.state_dict(), scaler)
            )
            self._ckpt_copy = ready
        trainer_state = self.state.to_trainer_state(
            total_steps=self.total_steps,
            train_seconds=self.state.train_seconds + time.perf_counter() - t_train0,
            wall_seconds=self.state.wall_before + time.time() - run.t_process,
        )
        # What --resume checks (train/resume.py).
        trainer_state["identity"] = run_dir.identity(run, self.total_steps)
        snap = checkpoint.Snapshot(
            step=self.state.step,
            model_state=model_state,
            optimizer={"optimizer": optim_state, "scaler": scaler},
            trainer_state=trainer_state,
            rng=checkpoint.rng_state(),
            loader_state=run.loader.state_dict(),
            ready=ready,
        )
        run.writer.submit(snap, blocking=blocking)
        self.state.ckpt_pause += time.perf_counter() - t0

    def _final_save(self, t_train0: float) -> None:
        """A last checkpoint (unless this step has one) and final/ (HF-loadable)."""
        if not self.save_final:
            self.run.writer.wait()  # no final model; still let async checkpoint writes finish
            return
        if self._last_ckpt_step != self.state.step:
            self.checkpoint(t_train0)  # on every rank: FSDP gathers the state collectively
        run = self.run
        state = None
        if run.fsdp:
            kept, self._final_state = self._final_state, None
            if kept is not None and kept[0] == self.state.step:  # the same on every rank
                state = kept[1]  # the last checkpoint's gather: no second full copy
            else:  # e.g. resumed from the last step's checkpoint: gather once, alone
                if self.is_main:
                    run.writer.wait()  # rank 0 never holds two full copies
                state = distributed.full_state(run.model)
        if self.is_main:
            write_final(
                run.model, run.tokenizer, run.out, state, run.cfg, before_publish=run.writer.wait
            )

    def _finish_quietly(self, status: str) -> None:
        """On a stop: let the checkpoint writer finish, record the summary, keep the error."""
        try:
            self.run.writer.wait()
        except checkpoint.CheckpointError as e:
            log.warning(f"pitstop: {e}")
        try:  # the error being raised is the one to report, not one from recording it
            if self.is_main:
                write_summary(self.run.out, self.summary(status))
            self.run_log.close()
        except Exception as err:
            log.warning(f"pitstop: warning: could not record the stopped run's summary ({err})")

    # --- reporting ------------------------------------------------------------------

    def summary(self, status: str) -> RunSummary:
        """The run's summary.json so far (built in pitstop.train.summary)."""
        run = self.run
        return trainer_summary(
            status,
            state=self.state,
            total_steps=self.total_steps,
            world_size=self.world_size,
            device=run.dev,
            device_type=run.device.type,
            choices=run.choices,
            measured=run.geometry.measured,
            planned_efficiency=run.geometry.efficiency,
            flops_per_token=run.flops_per_token,
            peak_flops=run.peak_flops,
            peak_source=run.peak_source,
            checkpoints=run.writer,
            t_process=run.t_process,
            cpu_start=run.cpu_start,
            out=run.out,
            config=run.cfg.to_dict(),
            resumed_from=self.resumed_from,
            final_saved=self.save_final,
            faults_per_step=self._faults_per_step(),
        )

    def _faults_per_step(self) -> float | None:
        """Minor page faults per step since this process's first step ended (its first
        touches of the run's memory are not a step's cost)."""
        if self._faults_from is None or self.state.step <= self._faults_from[0]:
            return None
        step, faults = self._faults_from
        return (host_malloc.minor_faults() - faults) / (self.state.step - step)
