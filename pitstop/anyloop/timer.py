"""`Watch`: pitstop's step timeline for any PyTorch training loop, through torch's global hooks.

No change to the loop is needed; while a `Watch` is started:

- step boundaries and the optimizer phase come from
  `torch.optim.optimizer.register_optimizer_step_pre_hook` / `..._post_hook`: a step ends
  when the (first) optimizer that steps finishes `step()`;
- forward: `torch.nn.modules.module.register_module_forward_pre_hook` / `..._forward_hook`
  time the calls of the model, the first module with parameters called at the outermost
  level with gradients enabled (so layers re-run by gradient checkpointing inside
  backward, a parameter-free loss module, or an evaluation pass do not count as forward);
- data_wait: `torch.utils.data.DataLoader.__iter__` is wrapped at the class level; every
  `next()` on its iterator (and `iter()` itself, where workers start) is charged to the
  step. A fetch with gradients disabled is an evaluation loop's: charged to "eval", its
  batches are not counted as trained tokens. Worker start-up (`iter()` and the first batch
  of an iterator whose `iter()` started workers) is named apart, as in `PitstopCallback`;
- checkpoint, gc_collect, empty_cache: `torch.save`, `gc.collect` and
  `torch.cuda.empty_cache` are replaced by timing wrappers (the originals are put back at
  `stop()`). A call from the loop's own thread between the phases above is charged to its
  phase and counted (events "checkpoints", "gc_collects", "empty_cache_calls"); a call
  inside a timed phase (a forward, the optimizer step, a batch fetch) is only counted,
  its time being that phase's; calls from other threads or processes are not timed;
- backward: whatever the step spends before the optimizer's `step()` that no phase above
  explains (input transfer, loss, backward, gradient clipping), as in `PitstopCallback`;
- other: the rest of the step (zero_grad, scheduler, logging), so phases add up.

Settings the doctor reads are observed: the autocast dtype and gradient checkpointing at
the model's first call; the optimizer class and the TF32 flags
(`torch.backends.cuda.matmul.allow_tf32`, `torch.backends.cudnn.allow_tf32`,
`torch.get_float32_matmul_precision()`) at the first optimizer step; the save interval
from the steps `torch.save` was called in; the world size from torch.distributed or
torchrun's WORLD_SIZE. Each rank counts the tokens of its own batches, and rank 0 writes.

Tokens are counted from the DataLoader's batches: a mapping with `input_ids` (seen tokens
from `attention_mask` where present; trained tokens are `labels != -100`, or the mask's
positions after the first of each row), a tuple whose first integer tensor is the ids and
second integer tensor of the same shape the labels, or a bare integer tensor of ids.

Results are written by `PitstopCallback`'s own code (subclassed in recorder.py), so a watched
loop, `pitstop train` and a Hugging Face run write one run format (summary.json,
metrics.jsonl, findings.json, pitstop_profile.json) that compare, report, doctor and
estimate read.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace, TracebackType
from typing import Any

from pitstop.anyloop.program import Program, detect_program
from pitstop.core.errors import ConfigError
from pitstop.measure.flops import flops_model
from pitstop.measure.forward_inputs import add_counts, forward_counts
from pitstop.measure.peak import module_shapes


class Watch:
    """Times every optimizer step of the training loop that runs while it is started.

    Use `pitstop.watch(...)` (a started-on-enter context manager) or `start()` / `stop()`.
    Only one Watch can be started in a process at a time (the hooks are global).
    """

    _active: Watch | None = None

    def __init__(
        self,
        output: str | os.PathLike[str] | None = None,
        *,
        warmup_steps: int = 1,
        doctor: bool = True,
        print_report: bool = True,
        cuda_sync: bool = True,
        cache_dir: str | os.PathLike[str] | None = None,
        command: list[str] | None = None,
    ) -> None:
        self.output = Path(output) if output is not None else None
        self.command = list(command or [])
        self.failed = False
        self._options = {
            "warmup_steps": warmup_steps,
            "cuda_sync": cuda_sync,
            "doctor": doctor,
            "print_report": print_report,
            "cache_dir": cache_dir,
        }
        self._recorder: Any = None  # made at the first event: see `_rec`
        self._handles: list[Any] = []
        self._patched: tuple[type, Any] | None = None
        self._pid = os.getpid()
        self._started = False
        self._root: Any = None  # the model: see the module docstring
        self._depth = 0
        self._fwd_t0: float | None = None
        self._step_optimizer: int | None = None  # id() of the optimizer whose step ends a step
        self._opt_t0: float | None = None
        self._loader: Any = None
        self._micro: list[int] = []  # forward calls of the model per optimizer step
        self._save_steps: set[int] = set()  # the steps (1-based) torch.save was timed in
        self._settings: dict[str, Any] = {}
        self._exit_registered = False
        self._observed: list[tuple[Any, str, Any, Any]] = []  # (owner, name, original, wrapper)
        self._thread = threading.get_ident()
        self._calling = False  # inside an observed call (one calling another is not timed twice)
        self._fetching = False  # inside a DataLoader next(): its time is data_wait
        self._tail = (0.0, False)  # an epoch end's wait after a step ended: see _epoch_end
        self._seen_train_mode = False  # the model was seen in train() mode (eval(): evaluation)
        self._eval: _EvalSpan | None = None  # the evaluation in progress: see _begin_eval
        self._eval_steps: set[int] = set()  # the steps (1-based) an evaluation ran in
        self._in_eval_forward = False
        self._closure_s = 0.0  # this step's time inside optimizer.step(closure)'s closure
        self._forward_rows: list[int] = []  # rows of each training forward (the micro-batch)
        self._program: Program | None = None  # what runs the loop: see anyloop/program.py

    @property
    def _rec(self) -> Any:
        """The step bookkeeping (pitstop.anyloop.recorder), made at the first event it records.

        Made lazily because it loads transformers (seconds): a process that never trains
        (a torchrun launcher, a DataLoader worker) or a loop without transformers pays it
        once, before the first timed interval, not at start-up.
        """
        if self._recorder is None:
            from pitstop.anyloop.recorder import LoopRecorder

            self._recorder = LoopRecorder(self, **self._options)
            self._recorder._mark = time.perf_counter()
        return self._recorder

    # --- results ------------------------------------------------------------------------

    @property
    def summary(self) -> Any:
        """summary.json's content once stopped, a `pitstop.core.run_record.RunSummary` (None before)."""
        return None if self._recorder is None else self._recorder.summary

    @property
    def profile(self) -> dict[str, Any] | None:
        """The profile (schema pitstop.profile/1) once stopped."""
        return None if self._recorder is None else self._recorder.profile

    @property
    def report(self) -> dict[str, Any] | None:
        """The doctor's report once stopped (None with doctor=False)."""
        return None if self._recorder is None else self._recorder.report

    def format(self) -> str:
        """The breakdown, the verdict and the doctor's findings, as printed at the end."""
        return self._rec.format()

    # --- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> Watch:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if et is not None and not issubclass(et, (KeyboardInterrupt, SystemExit)):
            self.failed = True
        self.stop()

    def start(self) -> Watch:
        """Install the global hooks; the next DataLoader fetch or model call opens step 1."""
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim_module
        from torch.utils.data import DataLoader

        if Watch._active is not None:
            raise ConfigError(
                "a pitstop watch is already running in this process (the hooks are global); "
                "stop it first, or use one watch around the whole loop"
            )
        Watch._active = self
        self._started = True
        self._handles = [
            optim_module.register_optimizer_step_pre_hook(self._opt_pre),
            optim_module.register_optimizer_step_post_hook(self._opt_post),
            nn_module.register_module_forward_pre_hook(self._fwd_pre),
            nn_module.register_module_forward_hook(
                self._fwd_post, with_kwargs=True, always_call=True
            ),
        ]
        original = DataLoader.__iter__
        watch = self

        def __iter__(loader: Any) -> Any:
            if Watch._active is not watch:
                return original(loader)
            from pitstop.hf import starts_workers

            watch._rec  # noqa: B018  (made now, before the timed iter())
            starts = starts_workers(loader)  # read before iter(), which sets _iterator
            t = time.perf_counter()
            it = original(loader)
            return watch._wrap(loader, it, t, time.perf_counter() - t, starts)

        DataLoader.__iter__ = __iter__  # type: ignore[method-assign]
        self._patched = (DataLoader, original)
        self._thread = threading.get_ident()
        self._observe_calls()
        return self

    def _observe_calls(self) -> None:
        """Replace torch.save, gc.collect and torch.cuda.empty_cache with timing wrappers."""
        import gc

        import torch

        wrappers: dict[int, Any] = {}  # one wrapper per function (torch.save is also
        # torch.serialization.save, empty_cache also torch.cuda.memory.empty_cache)
        for owner, name, phase, event in (
            (torch, "save", "checkpoint", "checkpoints"),
            (torch.serialization, "save", "checkpoint", "checkpoints"),
            (gc, "collect", "gc_collect", "gc_collects"),
            (torch.cuda, "empty_cache", "empty_cache", "empty_cache_calls"),
            (torch.cuda.memory, "empty_cache", "empty_cache", "empty_cache_calls"),
        ):
            original = getattr(owner, name, None)
            if original is None:
                continue
            if id(original) not in wrappers:
                wrappers[id(original)] = self._timed_call(original, phase, event)
            setattr(owner, name, wrappers[id(original)])
            self._observed.append((owner, name, original, wrappers[id(original)]))

    def _timed_call(self, original: Any, phase: str, event: str) -> Any:
        watch = self

        @functools.wraps(original)
        def observed(*args: Any, **kwargs: Any) -> Any:
            rec = watch._recorder
            if (
                Watch._active is not watch
                or watch._calling
                or rec is None
                or rec._cur is None  # before the first step: no step to charge
                or os.getpid() != watch._pid  # a forked DataLoader worker
                or threading.get_ident() != watch._thread  # e.g. a background saver thread
            ):
                return original(*args, **kwargs)
            # Inside a timed phase the call's time is already that phase's: count it only.
            inside = watch._depth > 0 or watch._opt_t0 is not None or watch._fetching
            if not inside:
                watch._end_eval()  # a save after an evaluation is not the evaluation's
            watch._calling = True
            try:
                if not inside:
                    rec._sync()  # device work queued before the call is not the call's
                t = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    now = time.perf_counter()
                    rec._event(event)
                    if not inside:
                        rec._add(phase, now - t)
                        if phase == "checkpoint":
                            watch._save_steps.add(len(rec._steps) + 1)
                        if rec._after_step_end:  # between steps: the last step ends after it
                            rec._mark = now
            finally:
                watch._calling = False

        return observed

    def stop(self) -> Any:
        """Remove the hooks; on rank 0 write the run (when `output` is set) and print the report.

        Returns summary.json's content (a RunSummary), or None when no optimizer step ran
        or on other ranks.
        """
        if not self._started:
            return self.summary
        self._started = False
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._patched is not None:
            cls, original = self._patched
            cls.__iter__ = original
            self._patched = None
        for owner, name, original, wrapper in reversed(self._observed):
            if getattr(owner, name, None) is wrapper:  # not if someone replaced ours since
                setattr(owner, name, original)
        self._observed = []
        if Watch._active is self:
            Watch._active = None
        if os.getpid() != self._pid or self._step_optimizer is None:
            return None  # a forked worker, or no optimizer stepped: nothing to say
        self._end_eval()
        rank, _ = self._settings.get("process") or _process()
        rank0 = rank == 0
        args = self._args()
        self._rec.on_train_end(args, SimpleNamespace(is_world_process_zero=rank0), None)
        return self._rec.summary

    def stop_at_exit(self) -> None:
        """Stop (and write) when the interpreter exits, if not stopped before."""
        if not self._exit_registered:
            self._exit_registered = True
            atexit.register(self.stop)

    # --- the hooks ----------------------------------------------------------------------

    def _wrap(self, loader: Any, it: Any, t_iter: float, iter_s: float, starts: bool) -> Any:
        if self._loader is None and _grad_enabled() and not self._model_in_eval():
            self._loader = loader
            self._rec._dataset = getattr(loader, "dataset", None)
        return _TimedIterator(it, self, loader, t_iter, iter_s, starts)

    def _epoch_end(self, wait: float, stops: bool) -> None:
        """The wait of the `next()` that ended an epoch (workers shut down there).

        After a step has ended it is held until a next step opens, which closes the last one
        after it; after the run's last step no step spans it, and it is left out (as the
        Trainer's end is in PitstopCallback). Inside an open step it is that step's.
        """
        rec = self._rec
        if rec._after_step_end:
            self._tail = (self._tail[0] + wait, self._tail[1] or stops)
        else:
            rec._add("data_wait", wait)
            if stops:
                rec._worker_stopped(wait)

    def _open_if_needed(self, at: float | None = None) -> None:
        """Open a step (at `at`, default now) unless one is open; the previous one ends there."""
        rec = self._rec
        if rec._after_step_end or rec._cur is None:
            now = time.perf_counter() if at is None else at
            wait, stops = self._tail
            if wait:  # the previous epoch's end, inside the step that ends now
                rec._add("data_wait", wait)
                if stops:
                    rec._worker_stopped(wait)
                self._tail = (0.0, False)
            rec._close(now)
            rec._open(now)
            self._micro.append(0)

    def _fwd_pre(self, module: Any, args: Any) -> None:
        if self._depth == 0:
            kind = self._forward_kind(module)
            if kind == "train":
                self._rec  # noqa: B018  (made before the step's clock starts)
                self._in_eval_forward = False  # an evaluation forward that raised ended there
                self._end_eval()
                self._open_if_needed()
                self._micro[-1] += 1
                self._fwd_t0 = time.perf_counter()
            elif kind == "eval":
                self._begin_eval(time.perf_counter())
                self._in_eval_forward = True
        self._depth += 1

    def _fwd_post(self, module: Any, args: Any, *rest: Any) -> None:
        # (kwargs, output); torch calls an always_call hook with (output,) alone when the
        # forward raised.
        kwargs, output = rest if len(rest) == 2 else ({}, rest[-1] if rest else None)
        self._depth = max(0, self._depth - 1)
        if self._depth != 0 or module is not self._root:
            return
        if self._in_eval_forward:
            self._in_eval_forward = False
            self._rec._sync()
            self._touch_eval(time.perf_counter(), forwards=1)
            return
        if self._fwd_t0 is None:
            return
        self._rec._sync()
        self._rec._add("forward", time.perf_counter() - self._fwd_t0)
        self._fwd_t0 = None
        cur = self._rec._cur
        if cur is None:
            return
        counts = forward_counts(module, args, kwargs)
        if counts is not None:
            add_counts(cur, counts)
            cur["forward_counted"] = True
            self._forward_rows.append(counts.rows)
        loss = output.get("loss") if hasattr(output, "get") else getattr(output, "loss", None)
        if loss is None and isinstance(output, (tuple, list)):  # nanoGPT: (logits, loss)
            loss = next((x for x in output[1:] if _scalar(x)), None)
        if _scalar(loss):
            cur.setdefault("loss_t", []).append(loss.detach())

    def _forward_kind(self, module: Any) -> str | None:
        """ "train" for the model's training forward, "eval" for its evaluation forward (no
        gradients, or eval() mode once it was seen training), None for any other call."""
        if self._root is None:
            return "train" if self._is_root(module) else None
        if module is not self._root:
            return None
        if not _grad_enabled() or (self._seen_train_mode and not module.training):
            return "eval"
        self._seen_train_mode = self._seen_train_mode or bool(module.training)
        return "train"

    def _model_in_eval(self) -> bool:
        """The model is in eval() mode after being seen training: an evaluation is running."""
        root = self._root
        return root is not None and self._seen_train_mode and not root.training

    # --- evaluation: a phase of its own -------------------------------------------------

    def _begin_eval(self, t: float) -> None:
        """An evaluation forward or fetch at `t`: opens an evaluation unless one is open.

        An evaluation runs from its first forward or fetch to its last; the time between
        them (the loop cutting its next batch, moving it to the device, reading the loss)
        is the evaluation's too. It ends at the next training forward, training fetch,
        optimizer step, timed save, or the watch's end."""
        if self._eval is None:
            self._eval = _EvalSpan(t0=t, end=t, named=_named(self._rec._cur))

    def _touch_eval(self, now: float, forwards: int = 0) -> None:
        if self._eval is not None:
            self._eval.end = now
            self._eval.forwards += forwards

    def _end_eval(self) -> None:
        ev, self._eval = self._eval, None
        if ev is None:
            return
        rec = self._rec
        if rec._cur is None:
            return  # before the first step (an evaluation before training): no step to charge
        # Time another phase took inside the evaluation (a save, a gc) is that phase's.
        seconds = max(0.0, ev.end - ev.t0 - (_named(rec._cur) - ev.named))
        rec._add("eval", seconds)
        rec._event("evals")
        rec._event("eval_forwards", ev.forwards)
        self._eval_steps.add(len(rec._steps) + 1)
        if rec._after_step_end:  # between steps: the last step ends after it
            rec._mark = ev.end

    def _is_root(self, module: Any) -> bool:
        if not _grad_enabled():
            return False
        if self._root is None:
            params = list(module.parameters())
            if not params:
                return False
            self._root = module
            self._seen_train_mode = bool(module.training)
            self._observe_model(module, params[0])
        return module is self._root

    def _opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        self._rec  # noqa: B018  (made before the clock is read)
        self._end_eval()
        if self._step_optimizer is None:
            self._step_optimizer = id(optimizer)
            self._observe_optimizer(optimizer)
            self.stop_at_exit()  # registered now, so it runs before torch's own exit handlers
        self._open_if_needed()
        rec = self._rec
        rec._sync()
        now = time.perf_counter()
        if id(optimizer) == self._step_optimizer and rec._cur is not None:
            cur = rec._cur
            named = sum(v for k, v in cur["phases"].items() if k != "other")
            rec._add("backward", max(0.0, now - cur["t0"] - named))
        self._opt_t0 = now
        return self._time_closure(args, kwargs)

    def _time_closure(self, args: Any, kwargs: Any) -> Any:
        """`step(closure)` (Lightning's automatic optimization, LBFGS): the closure runs the
        forward and backward inside the step, so it is timed apart and charged to them;
        only the rest of the step is the optimizer's. None when there is no closure."""
        closure = (kwargs or {}).get("closure")
        positional = closure is None and len(args) > 1 and callable(args[1])
        if positional:
            closure = args[1]
        if closure is None or not callable(closure):
            return None
        watch = self

        def timed_closure(*a: Any, **k: Any) -> Any:
            rec = watch._rec
            forward0 = _phase(rec._cur, "forward")
            t = time.perf_counter()
            try:
                return closure(*a, **k)
            finally:
                rec._sync()
                dt = time.perf_counter() - t
                watch._closure_s += dt
                rec._add("backward", max(0.0, dt - (_phase(rec._cur, "forward") - forward0)))

        if positional:
            return (args[0], timed_closure, *args[2:]), kwargs
        return args, {**kwargs, "closure": timed_closure}

    def _opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        rec = self._rec
        rec._sync()
        now = time.perf_counter()
        if self._opt_t0 is not None:
            rec._add("optimizer", max(0.0, now - self._opt_t0 - self._closure_s))
            self._opt_t0 = None
        self._closure_s = 0.0
        if id(optimizer) == self._step_optimizer:
            rec._mark = now
            rec._after_step_end = True

    # --- what the loop's settings were (for the doctor and `compare`) -------------------

    def _observe_model(self, model: Any, param: Any) -> None:
        import torch

        rec = self._rec  # made here, at the model's first call, before its forward is timed
        dev = param.device
        rec._cuda = dev.type == "cuda"
        try:
            rec._flops_model = flops_model(model)
        except Exception:  # a model whose parameters cannot be counted: no MFU
            rec._flops_model = None
        try:
            self._settings["model_shapes"] = module_shapes(model)
        except Exception:  # shapes unreadable: the precision finding measures no ratio
            self._settings["model_shapes"] = None
        amp = torch.is_autocast_enabled(dev.type) if dev.type in ("cpu", "cuda") else False
        dtype = torch.get_autocast_dtype(dev.type) if amp else param.dtype
        self._settings.update(
            device=dev,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            gradient_checkpointing=_checkpointing(model),
            model_class=type(model).__name__,
        )

    def _observe_optimizer(self, optimizer: Any) -> None:
        from pitstop.advise.environment import tf32_state

        self._settings["optimizer"] = type(optimizer).__name__
        # Read at the first step: a loop sets them before it trains, and they hold for the run
        # (a process group is often destroyed before the interpreter exits, where stop() runs).
        self._settings["tf32"] = tf32_state()
        self._settings["process"] = _process()
        self._program = detect_program()

    def _args(self) -> SimpleNamespace:
        """The loop's settings, as the TrainingArguments fields the doctor reads."""
        import torch

        s = self._settings
        loader = self._loader
        micro = sorted(self._micro[1:] or self._micro) or [1]
        hf: dict[str, Any] = {
            "bf16": bool(s.get("bf16")),
            "fp16": bool(s.get("fp16")),
            "gradient_checkpointing": bool(s.get("gradient_checkpointing")),
            "gradient_accumulation_steps": max(1, micro[len(micro) // 2]),
            "max_steps": len(self._rec._steps) + (self._rec._cur is not None),
            "report_to": [],
        }
        tf32 = s.get("tf32")
        if tf32 is not None:
            # HF's tf32=True sets the matmul flag (and cuDNN's, which PyTorch already enables
            # by default): the matmul flag is the one a loop sets or leaves.
            hf["tf32"] = bool(tf32["matmul_allow_tf32"])
        every = _save_interval(sorted(self._save_steps))
        if every is not None:
            hf.update(save_strategy="steps", save_steps=every)
        every = _save_interval(sorted(self._eval_steps))
        if every is not None:
            hf.update(eval_strategy="steps", eval_steps=every)
        program = self._program or Program()
        if program.args:  # a Trainer's own arguments: the truth where the hooks saw less
            observed = {k: hf[k] for k in ("bf16", "fp16", "gradient_accumulation_steps")}
            hf = {**hf, **program.args, **observed, "max_steps": hf["max_steps"]}
            loader = None
        if loader is None and self._forward_rows and not program.args:  # batches cut by hand
            rows = sorted(self._forward_rows)
            hf["per_device_train_batch_size"] = rows[len(rows) // 2]
        if loader is not None:
            hf.update(
                per_device_train_batch_size=getattr(loader, "batch_size", None) or 1,
                dataloader_num_workers=int(getattr(loader, "num_workers", 0)),
                dataloader_pin_memory=bool(getattr(loader, "pin_memory", False)),
                dataloader_persistent_workers=bool(getattr(loader, "persistent_workers", False)),
            )
            if getattr(loader, "prefetch_factor", None) is not None:
                hf["dataloader_prefetch_factor"] = loader.prefetch_factor
        return SimpleNamespace(
            device=s.get("device") or torch.device("cpu"),
            bf16=hf["bf16"],
            fp16=hf["fp16"],
            torch_compile=False,
            output_dir=str(self.output) if self.output is not None else None,
            world_size=(s.get("process") or _process())[1],
            to_dict=lambda: dict(hf),
        )


class _TimedIterator:
    """A DataLoader iterator whose `next()` is charged to the watched step.

    The first `next()` also carries `iter()`'s own `iter_s` seconds, and opens the step at
    `iter()`'s start `t_iter`; with `starts` (that `iter()` started workers) both are
    recorded as one worker start-up. A fetch for an evaluation (no gradients, or another
    loader than the training one while the model is in eval() mode) is the evaluation's.
    """

    def __init__(
        self, it: Any, watch: Watch, loader: Any, t_iter: float, iter_s: float, starts: bool
    ) -> None:
        self._it = it
        self._watch = watch
        self._loader = loader
        self._first: tuple[float, float, bool] | None = (t_iter, iter_s, starts)
        # Its workers are shut down (joined) when the epoch ends, unless they persist.
        self._stops = int(getattr(it, "_num_workers", 0) or 0) > 0 and not getattr(
            it, "_persistent_workers", False
        )

    def __iter__(self) -> _TimedIterator:
        return self

    def __len__(self) -> int:
        return len(self._it)

    def _evaluating(self) -> bool:
        w = self._watch
        return not _grad_enabled() or (self._loader is not w._loader and w._model_in_eval())

    def __next__(self) -> Any:
        w = self._watch
        if self._evaluating():  # an evaluation loop's fetch: its time is the evaluation's
            t = time.perf_counter()
            w._begin_eval(t if self._first is None else self._first[0])
            self._first = None
            try:
                return next(self._it)
            finally:
                w._touch_eval(time.perf_counter())
        w._end_eval()
        first, self._first = self._first, None
        t = time.perf_counter()
        w._fetching = True
        try:
            batch = next(self._it)
        except StopIteration:  # the epoch's end opens no step; its wait stays with the last
            w._epoch_end(time.perf_counter() - t, self._stops)
            raise
        finally:
            w._fetching = False
        rec = w._rec
        w._open_if_needed(at=t if first is None else first[0])
        wait = time.perf_counter() - t + (0.0 if first is None else first[1])
        rec._add("data_wait", wait)
        if first is not None and first[2]:
            rec._worker_started(wait)
        rec._count_batch(batch)  # the fallback count, for forwards whose inputs hold no ids
        return batch

    def __getattr__(self, name: str) -> Any:  # anything else a loop asks the iterator
        return getattr(self._it, name)


# A step's record as PitstopCallback keeps it (hf.py `_open`): its phases, counts and events.
Step = dict[str, Any]


@dataclass
class _EvalSpan:
    """An evaluation in progress: from its first forward or fetch (`t0`) to its last
    (`end`), its forwards, and the seconds the step's named phases held at its start."""

    t0: float
    end: float
    named: float
    forwards: int = 0


def _named(cur: Step | None) -> float:
    """Seconds a step's named phases hold so far (every phase but "other")."""
    if cur is None:
        return 0.0
    return sum(v for k, v in cur["phases"].items() if k != "other")


def _phase(cur: Step | None, name: str) -> float:
    return 0.0 if cur is None else float(cur["phases"].get(name, 0.0))


def _scalar(x: Any) -> bool:
    return hasattr(x, "detach") and hasattr(x, "numel") and x.numel() == 1


def _checkpointing(model: Any) -> bool:
    """Whether a transformers model recomputes activations (newer releases rename the flag)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the old name's deprecation warning is not the user's
        for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
            value = getattr(model, name, None)
            if isinstance(value, bool):
                return value
    return False


def _save_interval(steps: list[int]) -> int | None:
    """The usual number of steps between saves (the median gap), from 2 saves on."""
    gaps = sorted(b - a for a, b in itertools.pairwise(steps))
    return gaps[len(gaps) // 2] if gaps else None


def _process() -> tuple[int, int]:
    """(rank, world size): torch.distributed's group, else torchrun's RANK / WORLD_SIZE, else
    (0, 1): one process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())

    def env(name: str, default: int) -> int:
        try:
            return int(os.environ.get(name) or default)
        except ValueError:  # not a number: no launcher set it
            return default

    return env("RANK", 0), max(1, env("WORLD_SIZE", 1))


def _grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()


def watch(
    output: str | os.PathLike[str] | None = None,
    *,
    warmup_steps: int = 1,
    doctor: bool = True,
    print_report: bool = True,
    cuda_sync: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Watch:
    """Time the training loop in the `with` block (or between `start()` and `stop()`).

        with pitstop.watch(output="runs/baseline"):
            for batch in loader:
                loss = model(**batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()

    At the end it prints the step breakdown, the bottleneck verdict and the doctor's
    findings, and (with `output`) writes the run format `pitstop train` writes, so
    `pitstop compare`, `report`, `doctor --profile OUTPUT/pitstop_profile.json` and
    `estimate --from-profile` read it. `warmup_steps` first optimizer steps are left out
    of the profile (they are kept in metrics.jsonl, marked "warmup").
    """
    if warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be 0 or more, got {warmup_steps}")
    return Watch(
        output,
        warmup_steps=warmup_steps,
        doctor=doctor,
        print_report=print_report,
        cuda_sync=cuda_sync,
        cache_dir=cache_dir,
    )


def mark_failed(watch_: Watch) -> None:
    """Record that the script ended with an uncaught exception (summary status says so)."""
    watch_.failed = True


def install_excepthook(watch_: Watch) -> None:
    """Mark the run incomplete when the script dies of an uncaught exception."""
    previous = sys.excepthook

    def hook(et: type[BaseException], ev: BaseException, tb: TracebackType | None) -> None:
        mark_failed(watch_)
        previous(et, ev, tb)

    sys.excepthook = hook
