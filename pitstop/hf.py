"""`PitstopCallback`: pitstop's step timeline for a Hugging Face `Trainer` or TRL `SFTTrainer`.

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[PitstopCallback()])
    trainer.train()   # prints the breakdown, the verdict and the doctor's findings, and writes
                      # to args.output_dir the run format `pitstop train` writes (summary.json,
                      # metrics.jsonl, findings.json) plus pitstop_profile.json, so
                      # `pitstop compare`, `report` and `estimate --from-profile` read it

How each phase is measured (transformers 5.x `Trainer._run_epoch`; callbacks receive the
prepared `train_dataloader` as a keyword argument):

- data_wait: the trainer draws every micro-batch of an optimizer step with `next()` before
  `on_step_begin`. In `on_train_begin` the dataloader's class is swapped for a subclass
  whose `__iter__` returns a timing iterator (`iter()` looks `__iter__` up on the type,
  so patching the instance would not work); `iter()` itself counts too, since that is
  where worker processes start. Worker start-up (`iter()` plus the first batch of an
  iterator whose `iter()` started workers: spawned workers import torch and the dataset
  before they load anything) stays inside data_wait and is also named on its own: the
  profile's "worker_startup" (seconds and starts, measured and warm-up steps apart).
- forward / backward: `on_step_begin` to `on_pre_optimizer_step` is the micro-batches'
  compute; forward hooks on the model time the forward passes inside it, and the rest is
  "backward" (input transfer, loss, backward and gradient clipping, which the Trainer
  does between the last backward and `on_pre_optimizer_step`).
- optimizer: `on_pre_optimizer_step` to `on_step_end` (optimizer, LR scheduler, zero_grad).
- logging / eval / checkpoint: from the previous event to `on_log`, `on_evaluate`, `on_save`.
- other: the rest of the step, so the phases add up to the step time.

A producer may add phases of its own (`pitstop.anyloop.timer.Watch` adds "gc_collect" and
"empty_cache" when the loop calls them); they appear only in runs that had them, and
"other" is still the rest, so the phases still add up.

A step runs from its first `next()` to the next step's first `next()` (the last one ends
at its last event), so the logging, evaluation and saving a step triggers belong to it.

On CUDA, host clocks only see device time where the host waits for the device, so by
default the callback synchronises at phase boundaries (`cuda_sync=True`): a profiling
run pays a few small pipeline bubbles per step for honest numbers. With
`cuda_sync=False` the device phases are where the host happened to block.

Importing this module needs nothing beyond transformers (and torch).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from pathlib import Path
from typing import Any

from pitstop.core.quiet_imports import without_bitsandbytes

with without_bitsandbytes():  # transformers' trainer utilities import peft, peft bitsandbytes
    from transformers import TrainerCallback

from pitstop.advise.doctor import DoctorReport, device_from_dict, doctor
from pitstop.advise.environment import environment
from pitstop.advise.profile_text import format_profile
from pitstop.core import host_malloc, run_record
from pitstop.core.atomic import write_json_atomic
from pitstop.core.cache_layout import cache_root
from pitstop.core.run_record import RunSummary, StepLine, write_steps, write_summary
from pitstop.measure.flops import flops_model
from pitstop.measure.forward_inputs import add_counts, batch_counts
from pitstop.measure.machine import cpu_snapshot, machine_load
from pitstop.measure.memory import peak_memory
from pitstop.measure.peak import module_shapes, trusted_mfu
from pitstop.measure.schema import make_profile
from pitstop.measure.timeline import PHASES
from pitstop.probe import DeviceInfo, detect_device

__all__ = ["PitstopCallback"]

# One optimizer step's record while it is timed and after: {"t0", "seconds", "phases",
# "targets", "seen", "positions", "rows", "events", "worker_startup_s", ...} (`_open`).
Step = dict[str, Any]

# The doctor's sample of the training rows stops after this long (a dataset that
# tokenizes in __getitem__ can take seconds per thousand rows).
DATA_SECONDS = 2.0


def starts_workers(loader: Any) -> bool:
    """Whether `iter(loader)` starts worker processes: it has workers and does not reuse them.

    Read before `iter()`: persistent workers are started by the first `iter()` only (the
    loader keeps that iterator in `_iterator` and resets it for the next epoch).
    """
    if int(getattr(loader, "num_workers", 0) or 0) <= 0:
        return False
    return not (
        getattr(loader, "persistent_workers", False)
        and getattr(loader, "_iterator", None) is not None
    )


class _TimedIterator:
    """Wraps a dataloader iterator; every `next()` is charged to data_wait.

    `startup`: seconds its `iter()` took when that started workers; the first `next()`
    then waits for them too, and both are recorded as one worker start-up.
    """

    def __init__(self, it: Any, cb: PitstopCallback, startup: float | None = None) -> None:
        self._it = it
        self._cb = cb
        self._startup = startup

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        cb = self._cb
        cb._data_start()
        t = time.perf_counter()
        try:
            batch = next(self._it)
        finally:
            dt = time.perf_counter() - t
            cb._add("data_wait", dt)
            if self._startup is not None:
                cb._worker_started(self._startup + dt)
                self._startup = None
        cb._count_batch(batch)
        return batch

    def __getattr__(self, name: str) -> Any:  # anything else the trainer asks the iterator
        return getattr(self._it, name)


def _timed_class(cls: type, cb: PitstopCallback) -> type:
    def __iter__(self: Any) -> _TimedIterator:
        starts = starts_workers(self)
        cb._data_start()
        t = time.perf_counter()
        it = super(timed, self).__iter__()
        dt = time.perf_counter() - t
        cb._add("data_wait", dt)
        return _TimedIterator(it, cb, startup=dt if starts else None)

    timed = type(f"Timed{cls.__name__}", (cls,), {"__iter__": __iter__, "_pitstop_original": cls})
    return timed


def _set_class(obj: Any, cls: type) -> None:
    """`obj.__class__ = cls`, also for accelerate's DataLoaderAdapter, whose `__class__`
    property (it reports the wrapped DataLoader's class to isinstance) has no setter; the
    descriptor of `object` still assigns the real type."""
    try:
        obj.__class__ = cls
    except AttributeError:
        object.__dict__["__class__"].__set__(obj, cls)


class PitstopCallback(TrainerCallback):
    """Records pitstop's step timeline in a transformers Trainer; see the module docstring.

    Args:
        warmup_steps: optimizer steps left out of the profile (first-step allocation, lazy init).
        cuda_sync: synchronise CUDA at phase boundaries so host clocks measure device work.
        doctor: run the doctor's rules on the arguments and the measured profile at the end.
        print_report: print the breakdown, verdict and findings at the end of training.
        cache_dir: where the CPU peak FLOP/s (for MFU) is cached; default $PITSTOP_CACHE_DIR
            or ~/.cache/pitstop.
        requested: settings of the run that TrainingArguments does not hold or refused on
            this machine (e.g. {"max_length": 512} of the tokenization, or {"tf32": True},
            which TrainingArguments refuses without an Ampere GPU); recorded in summary.json
            under "requested" so `pitstop compare` lists them with the other settings.
        doctor_data_rows: at most this many rows of the Trainer's train dataset are
            measured for the doctor's data rules (padding, max length, truncation).
    """

    def __init__(
        self,
        warmup_steps: int = 1,
        *,
        cuda_sync: bool = True,
        doctor: bool = True,
        print_report: bool = True,
        cache_dir: str | os.PathLike[str] | None = None,
        requested: dict[str, Any] | None = None,
        doctor_data_rows: int = 2000,
    ) -> None:
        self.warmup_steps = max(0, int(warmup_steps))
        self.cuda_sync = cuda_sync
        self.run_doctor = doctor
        self.print_report = print_report
        self.cache_dir = cache_dir
        self.requested = dict(requested or {})
        self.doctor_data_rows = int(doctor_data_rows)
        self.summary: RunSummary | None = None
        self.profile: dict[str, Any] | None = None
        self.report: DoctorReport | None = None
        self._reset()

    # --- bookkeeping -----------------------------------------------------------------------

    def _reset(self) -> None:
        self._steps: list[Step] = []  # closed steps: {"seconds", "phases", "tokens", ...}
        self._cur: Step | None = None
        self._after_step_end = True  # the next data fetch opens a new step
        self._mark = time.perf_counter()
        self._compute_t0: float | None = None
        self._opt_t0: float | None = None
        self._fwd_t0: float | None = None
        self._in_compute = False
        self._in_eval = False
        self._hooks: list[Any] = []
        self._dataloader: Any = None
        self._cuda = False
        self._cpu_start = cpu_snapshot()  # other processes' share is measured from here
        self._flops_per_position: float | None = None
        self._t_begin = time.perf_counter()
        self._dataset: Any = None
        self._world_size: int | None = None
        self._peak: tuple[float | None, str | None] = (None, None)  # MFU's denominator, its source

    def _open(self, now: float) -> None:
        self._cur = {
            "t0": now,
            "phases": dict.fromkeys(PHASES, 0.0),
            "targets": [],
            "seen": [],
            "positions": 0,
            "rows": 0,
            "events": {"checkpoints": 0, "evals": 0, "logs": 0},
            "worker_startup_s": 0.0,
            "worker_shutdown_s": 0.0,
            "faults": host_malloc.minor_faults(),  # the step's own count, at _close
        }
        self._after_step_end = False

    def _close(self, end: float) -> None:
        cur = self._cur
        if cur is None:
            return
        seconds = max(end - cur["t0"], 0.0)
        named = sum(v for k, v in cur["phases"].items() if k != "other")
        cur["phases"]["other"] = max(0.0, seconds - named)
        cur["seconds"] = seconds
        cur["faults"] = host_malloc.minor_faults() - cur["faults"]
        self._steps.append(cur)
        self._cur = None

    def _data_start(self) -> None:
        if self._after_step_end or self._cur is None:
            now = time.perf_counter()
            self._close(now)
            self._open(now)

    def _add(self, phase: str, seconds: float) -> None:
        if self._cur is not None:
            phases = self._cur["phases"]
            phases[phase] = phases.get(phase, 0.0) + seconds  # a producer's own phase too

    def _event(self, name: str, n: int = 1) -> None:
        """Count `n` events `name` (checkpoints, gc_collects, ...) in the open step."""
        if self._cur is not None:
            events = self._cur["events"]
            events[name] = events.get(name, 0) + n

    def _worker_started(self, seconds: float) -> None:
        """Record one start of DataLoader workers that kept the step waiting `seconds`."""
        if self._cur is not None:
            self._cur["worker_startup_s"] += seconds
            self._event("worker_startups")

    def _worker_stopped(self, seconds: float) -> None:
        """Record the shut-down of DataLoader workers at an epoch's end (inside data_wait)."""
        if self._cur is not None:
            self._cur["worker_shutdown_s"] += seconds
            self._event("worker_shutdowns")

    def _count_batch(self, batch: Any) -> None:
        """Count a training batch's rows, positions, non-padding and loss-carrying tokens
        (kept on the device and summed at the end: reading them now would sync)."""
        if self._cur is None:
            return
        counts = batch_counts(batch)
        if counts is not None:
            add_counts(self._cur, counts)

    def _sync(self) -> None:
        if self._cuda and self.cuda_sync:
            import torch

            torch.cuda.synchronize()

    # --- callback hooks --------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._reset()
        self.profile = self.report = None
        model = kwargs.get("model")
        self._cuda = getattr(getattr(args, "device", None), "type", "cpu") == "cuda"
        dl = kwargs.get("train_dataloader")
        self._dataset = getattr(dl, "dataset", None)
        if dl is not None and not hasattr(type(dl), "_pitstop_original"):
            try:
                _set_class(dl, _timed_class(type(dl), self))
                self._dataloader = dl
            except (
                TypeError,
                AttributeError,
            ):  # a C-level or slotted class; data_wait then lands in "other"
                self._dataloader = None
        if model is not None and not getattr(args, "torch_compile", False):
            # Hooks inside a compiled graph would be traced, not timed; without them forward
            # and backward are reported together under "backward".
            self._hooks = [
                model.register_forward_pre_hook(self._fwd_pre),
                model.register_forward_hook(self._fwd_post),
            ]
        if model is not None:
            try:
                self._flops_model = flops_model(model)
            except Exception:  # an exotic model without embeddings API: no MFU
                self._flops_model = None
        self._mark = time.perf_counter()

    def _fwd_pre(self, *_: Any) -> None:
        if self._in_compute:
            self._fwd_t0 = time.perf_counter()

    def _fwd_post(self, *_: Any) -> None:
        if self._in_compute and self._fwd_t0 is not None:
            self._sync()
            self._add("forward", time.perf_counter() - self._fwd_t0)
            self._fwd_t0 = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._after_step_end or self._cur is None:
            # No data fetch was seen since the last step (a dataloader we could not wrap, or
            # one the Trainer replaced, e.g. when skipping batches on resume): start here.
            self._data_start()
        self._compute_t0 = time.perf_counter()
        self._in_compute = True

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._sync()
        now = time.perf_counter()
        if self._compute_t0 is not None and self._cur is not None:
            total = now - self._compute_t0
            self._add("backward", max(0.0, total - self._cur["phases"]["forward"]))
        self._in_compute = False
        self._opt_t0 = now

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._sync()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._sync()
        now = time.perf_counter()
        if self._opt_t0 is not None:
            self._add("optimizer", now - self._opt_t0)
        self._opt_t0 = None
        self._in_compute = False
        self._mark = now
        self._after_step_end = True

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if self._in_eval or (logs and "train_runtime" in logs):
            return  # eval metrics are charged to eval; the final summary log is after the run
        now = time.perf_counter()
        self._add("logging", now - self._mark)
        self._event("logs")
        if self._cur is not None and logs and isinstance(logs.get("loss"), (int, float)):
            self._cur["loss"] = float(logs["loss"])  # the mean since the previous log
        self._mark = now

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._in_eval = True

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = time.perf_counter()
        self._add("eval", now - self._mark)
        self._event("evals")
        self._mark = now
        self._in_eval = False

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = time.perf_counter()
        self._add("checkpoint", now - self._mark)
        self._event("checkpoints")
        self._mark = now

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close(self._mark)  # the last step ends at its last event, not at the summary
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._dataloader is not None:
            _set_class(self._dataloader, type(self._dataloader)._pitstop_original)
            self._dataloader = None
        ws = getattr(args, "world_size", None)  # TrainingArguments: the processes training
        self._world_size = ws if isinstance(ws, int) and not isinstance(ws, bool) else None
        if not getattr(state, "is_world_process_zero", True):
            return
        self.profile = self._build_profile(args, kwargs.get("model"))
        self.profile["machine"] = machine_load(since=self._cpu_start)
        out = Path(args.output_dir) if getattr(args, "output_dir", None) else None
        if self.run_doctor:
            self.report = self._doctor(args)
        self.summary = self._build_summary()
        if out is not None:
            self._write(out)
        if self.print_report:
            print(self.format())

    # --- results ---------------------------------------------------------------------------

    def _step_records(self) -> list[StepLine]:
        """metrics.jsonl lines in `pitstop train`'s format (cumulative token counts)."""
        out, trained, seen, padded = [], 0, 0, 0
        for i, s in enumerate(self._steps, 1):
            n_t = int(sum(float(t) for t in s["targets"]))  # one sync per step, at the end
            trained += n_t
            seen += int(sum(float(t) for t in s["seen"]))
            padded += s["positions"]
            line = {
                "step": i,
                "loss": s.get("loss"),
                "warmup": i <= self.profile["warmup"],
                "trained_tokens": trained,
                "seen_tokens": seen,
                "padded_tokens": padded,
                "step_trained_tokens": n_t,
                "step_rows": s["rows"],
                "tokens_per_second": n_t / s["seconds"] if s["seconds"] > 0 else None,
                "step_seconds": s["seconds"],
                **{f"{k}_s": v for k, v in s["phases"].items()},
            }
            if s["worker_startup_s"]:  # inside data_wait_s: not a "_s" key, which is a phase
                line["worker_startup_seconds"] = s["worker_startup_s"]
            out.append(StepLine.from_json(line))  # the checks read_steps makes on the file
        return out

    def _build_summary(self) -> RunSummary:
        """summary.json as `pitstop train` writes it, from what the Trainer let us see."""
        assert self.profile is not None
        p = self.profile
        lines = self._step_records()
        self._lines = lines
        last = lines[-1] if lines else StepLine()
        train_s = sum(s["seconds"] for s in self._steps)
        # Training throughput leaves out the evaluations' seconds (they train nothing).
        training_s = train_s - sum(s["phases"].get("eval", 0.0) for s in self._steps)
        trained = last.trained_tokens or 0
        seen, padded = float(last.seen_tokens or 0), float(last.padded_tokens or 0)
        losses = [r.loss for r in lines if r.loss is not None]
        rows = sum(s["rows"] for s in self._steps)
        # The phases of the steps the profile measured (after its warm-up), so a share read
        # from time_breakdown (compare's data-wait share) is the share the profile prints;
        # the warm-up steps' phases are kept apart, under "profile".
        warm = int(p.get("warmup") or 0)
        breakdown, warm_breakdown = (
            _phase_totals(self._steps[warm:]),
            _phase_totals(self._steps[:warm]),
        )
        startup = p.get("worker_startup") or {}
        profile = {
            "model_shapes": p.get("model_shapes"),
            "warmup_steps": p.get("warmup"),
            "tokens_per_second": p.get("tokens_per_second"),
            "time_breakdown_steps": f"the {len(self._steps) - warm} steps after {warm} warm-up",
            "warmup_time_breakdown": warm_breakdown,
        }
        if startup:
            profile["worker_startup_seconds"] = startup["seconds"] + startup["warmup_seconds"]
            profile["worker_startups"] = startup["starts"] + startup["warmup_starts"]
        return RunSummary(
            status="completed",
            source="hf",
            optimizer_steps=len(lines),
            trained_tokens=trained,
            seen_tokens=last.seen_tokens or 0,
            padded_tokens=last.padded_tokens or 0,
            rows=rows,
            train_seconds=train_s,
            # Trainer.train() start to end: the process's own start-up is not visible here.
            wall_seconds=time.perf_counter() - self._t_begin,
            tokens_per_second=trained / training_s if training_s > 0 else None,
            trained_tokens_per_step=trained / len(lines) if lines else None,
            mfu=p.get("mfu"),
            flops_per_token=p.get("flops_per_token"),
            peak_flops=self._peak[0],
            peak_flops_source=self._peak[1],
            padding_waste=1 - seen / padded if padded else None,
            peak_memory_bytes=p.get("peak_memory_bytes"),
            final_loss=losses[-1] if losses else None,
            time_breakdown=breakdown,
            device=p.get("device"),
            choices=p.get("choices") or {},
            config=p.get("config") or {},
            requested=self.requested,
            machine=p.get("machine"),
            profile=profile,
            world_size=self._world_size,
        )

    def _write(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        write_steps(out, self._lines)
        write_json_atomic(out / run_record.HF_PROFILE, self.profile)
        if self.report is not None:
            run_record.write_findings(out, self.report)
        assert self.summary is not None
        write_summary(out, self.summary)  # last: it marks the run complete

    def _device(self, args: Any) -> Any:

        dev_type = getattr(getattr(args, "device", None), "type", "cpu")
        index = getattr(getattr(args, "device", None), "index", None) or 0
        try:
            return detect_device("cuda" if dev_type == "cuda" else "cpu", index=index)[0]
        except Exception:  # a device pitstop does not know (mps, xpu): report it by name only
            return DeviceInfo(type=dev_type, name=dev_type, cpu_count=os.cpu_count() or 1)

    def _build_profile(self, args: Any, model: Any) -> dict[str, Any]:
        steps = self._steps
        warm = self.warmup_steps if len(steps) > self.warmup_steps else 0
        measured = steps[warm:]
        targets = 0.0
        for s in measured:
            targets += float(sum(float(t) for t in s["targets"]))  # one sync per step, at the end
        positions = sum(s["positions"] for s in measured)
        dev = self._device(args)
        precision = (
            "bf16"
            if getattr(args, "bf16", False)
            else ("fp16" if getattr(args, "fp16", False) else "fp32")
        )
        notes: list[str] = []
        mfu, flops_per_token = self._mfu(measured, dev, precision, notes)
        peak_mem = peak_memory("cuda" if self._cuda else "cpu")
        events: dict[str, int] = {"checkpoints": 0, "evals": 0, "logs": 0}
        for s in measured:
            for k, n in s["events"].items():
                events[k] = events.get(k, 0) + n
        if not self._hooks and getattr(args, "torch_compile", False):
            notes.append("torch_compile: forward and backward are reported together as backward")
        if self._dataloader is None and not any(s["phases"]["data_wait"] for s in steps):
            notes.append("the train dataloader could not be wrapped: data_wait is inside 'other'")
        try:
            config = args.to_dict()
        except Exception:
            config = {}
        profile = make_profile(
            [s["phases"] for s in measured],
            [s["seconds"] for s in measured],
            warmup=warm,
            source="hf",
            trained_tokens=targets,
            mfu=mfu,
            peak_memory_bytes=peak_mem,
            device=dev.to_dict(),
            choices={"precision": {"value": precision, "reason": "TrainingArguments bf16/fp16"}},
            config=config,
            events=events,
            notes=notes,
        )
        if model is not None:
            # Shapes unreadable: the precision finding then measures no ratio.
            with contextlib.suppress(Exception):
                profile["model_shapes"] = module_shapes(model)
        seen = sum(float(sum(float(t) for t in s["seen"])) for s in measured)
        profile["seen_tokens"], profile["padded_tokens"] = seen, positions
        profile["flops_per_token"] = flops_per_token
        profile.update(_worker_records(steps, warm))
        if not self._cuda and measured:
            # The median step: glibc's heap settles over the first few steps (a transient).
            faults = statistics.median(s["faults"] for s in measured)
            profile.update(host_malloc.fault_record(faults))
        return profile

    def _mfu(
        self, measured: list[Step], dev: Any, precision: str, notes: list[str]
    ) -> tuple[float | None, float | None]:
        """(MFU, FLOPs per position) of the measured steps' training time; a note when the
        MFU is withheld or its peak measured again (measure.peak.trusted_mfu)."""
        positions = sum(s["positions"] for s in measured)
        rows = sum(s["rows"] for s in measured)
        seconds = sum(s["seconds"] for s in measured)
        fm = getattr(self, "_flops_model", None)
        if fm is None or not (positions and seconds and rows):
            return None, None
        import torch

        flops_per_token = fm.per_token(round(positions / rows))
        # Training's rate: evaluation computes no training FLOPs and is a phase of its own.
        training = seconds - sum(s["phases"].get("eval", 0.0) for s in measured)
        got = trusted_mfu(
            positions / max(training, 1e-9),
            flops_per_token,
            dev,
            precision,
            bool(torch.backends.cuda.matmul.allow_tf32),
            cache_root(self.cache_dir),
        )
        self._peak = (got["peak_flops"], got["peak_source"])
        if got["note"]:
            notes.append(got["note"])
        return got["mfu"], flops_per_token

    def _doctor(self, args: Any) -> DoctorReport | None:

        assert self.profile is not None
        dev = device_from_dict(self.profile["device"])
        cls = self._args_class(args)
        env = environment(compile_check=False, device=dev)
        return doctor(
            hf_args=self.profile["config"],
            hf_class=cls if cls in ("TrainingArguments", "SFTConfig") else "auto",
            profile=self.profile,
            environment=env,
            device=dev,
            data=self._data_facts(),
            measured_here=True,
            cache_dir=cache_root(self.cache_dir),
        )

    def _args_class(self, args: Any) -> str:
        """The arguments' class name the doctor names fields by (SFTConfig, TrainingArguments)."""
        return type(args).__name__

    def _data_facts(self) -> Any:
        """Row lengths of the Trainer's train dataset, sampled evenly, in bounded time.

        Rows are read through `dataset[i]` (already tokenized by the user's pipeline), at
        most `doctor_data_rows` of them and for at most DATA_SECONDS; None when the rows
        carry no input_ids (the data rules then stay quiet, as without --data).
        """
        ds = self._dataset
        if ds is None or not hasattr(ds, "__len__") or not hasattr(ds, "__getitem__"):
            return None
        import numpy as np

        from pitstop.advise.facts import data_facts_from_lengths

        n = len(ds)
        if n == 0 or self.doctor_data_rows < 1:
            return None
        idx = np.unique(np.linspace(0, n - 1, min(n, self.doctor_data_rows)).astype(np.int64))
        lengths, t0 = [], time.perf_counter()
        try:
            for i in idx:
                row = ds[int(i)]
                ids = row.get("input_ids") if hasattr(row, "get") else None
                if ids is None:
                    return None
                lengths.append(len(ids))
                if time.perf_counter() - t0 > DATA_SECONDS:
                    break
        except Exception:  # a dataset that cannot be indexed outside its loader: no data facts
            return None
        return data_facts_from_lengths(lengths, source=f"{len(lengths)} of {n} training rows")

    def format(self) -> str:
        """The end-of-training report: phase breakdown, verdict, findings."""
        return format_profile(self.profile, self.report)


def _worker_records(steps: list[Step], warm: int) -> dict[str, dict[str, float]]:
    """The profile's "worker_startup" and "worker_shutdown", where workers started or stopped."""
    out: dict[str, dict[str, float]] = {}
    measured, warm_steps = steps[warm:], steps[:warm]
    if any(s["events"].get("worker_startups") for s in steps):
        # Inside data_wait, named apart: the warm-up's start-up is left out of every share
        # (spawned workers can take seconds), a start-up in measured steps (workers started
        # again each epoch) is part of the wait the verdict reads.
        out["worker_startup"] = {
            "seconds": round(sum(s["worker_startup_s"] for s in measured), 6),
            "starts": sum(s["events"].get("worker_startups", 0) for s in measured),
            "warmup_seconds": round(sum(s["worker_startup_s"] for s in warm_steps), 6),
            "warmup_starts": sum(s["events"].get("worker_startups", 0) for s in warm_steps),
        }
    if any(s["events"].get("worker_shutdowns") for s in measured):
        # Non-persistent workers are joined at each epoch's end: the counterpart of the
        # start-up, a cost every epoch pays again (inside data_wait, named apart).
        out["worker_shutdown"] = {
            "seconds": round(sum(s["worker_shutdown_s"] for s in measured), 6),
            "stops": sum(s["events"].get("worker_shutdowns", 0) for s in measured),
        }
    return out


def _phase_totals(steps: list[Step]) -> dict[str, float]:
    """Seconds per phase summed over `steps` (every PHASES name, and any other one seen)."""
    out = dict.fromkeys(PHASES, 0.0)
    for s in steps:
        for k, v in s["phases"].items():
            out[k] = out.get(k, 0.0) + v
    return out
