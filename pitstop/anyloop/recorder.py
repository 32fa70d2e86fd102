"""PitstopCallback's step bookkeeping and result writing, reused for any training loop.

`pitstop.anyloop.timer.Watch` feeds it from torch's global hooks; subclassing the
callback keeps one copy of the step records, the profile, the doctor call and the run
writer (summary.json, metrics.jsonl, findings.json, pitstop_profile.json).
"""

from __future__ import annotations

import os
from typing import Any

from pitstop.core.run_record import SOURCE_SCRIPT, RunSummary
from pitstop.hf import PitstopCallback
from pitstop.measure.forward_inputs import add_counts, batch_counts

# What the run's summary says produced it (`pitstop compare` lists it with the settings).
SOURCE = SOURCE_SCRIPT


class LoopRecorder(PitstopCallback):
    """PitstopCallback's step bookkeeping and result writing, driven by torch's global hooks."""

    def __init__(self, owner: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._owner = owner

    def _open(self, now: float) -> None:
        super()._open(now)
        assert self._cur is not None
        self._cur["fallback"] = {"rows": 0, "positions": 0, "seen": [], "targets": []}

    def _count_batch(self, batch: Any) -> None:
        """A training DataLoader batch: counted apart, and used only for a step whose model
        forwards held no token ids (the forwards' own inputs are what a step trains)."""
        if self._cur is None:
            return
        counts = batch_counts(batch)
        if counts is not None:
            add_counts(self._cur["fallback"], counts)

    def _close(self, end: float) -> None:
        cur = self._cur
        if cur is not None:
            fallback = cur.pop("fallback", None)
            if fallback and not cur.pop("forward_counted", False):
                cur.update(fallback)
        super()._close(end)

    def _args_class(self, args: Any) -> str:
        program = self._owner._program
        if program is not None and program.args_class:
            return program.args_class  # a Trainer script's own TrainingArguments / SFTConfig
        return super()._args_class(args)

    def _build_summary(self) -> RunSummary:
        summary = super()._build_summary()
        summary.source = SOURCE
        if self._owner.command:
            summary.command = [str(a) for a in self._owner.command]  # `compare --rerun` reruns it
            summary.command_cwd = os.getcwd()
        if self._owner.failed:
            summary.status = "incomplete: the training script exited with an error"
        return summary

    def _build_profile(self, args: Any, model: Any) -> dict[str, Any]:
        profile = super()._build_profile(args, model)
        profile["source"] = SOURCE  # its config is what the hooks observed, not declared
        program = self._owner._program
        profile["program"] = program.kind if program is not None else "loop"
        shapes = self._owner._settings.get("model_shapes")
        if shapes:
            profile["model_shapes"] = dict(shapes)
        precision = profile["choices"].get("precision")
        if isinstance(precision, dict):  # the callback's reason names TrainingArguments
            precision["reason"] = "observed: the autocast dtype, else the parameters' dtype"
        flags = self._owner._settings.get("tf32")
        if flags is not None:  # read at the first optimizer step (timer._observe_optimizer)
            profile["choices"]["tf32"] = {
                "value": bool(flags["matmul_allow_tf32"]),
                "reason": "observed at the first optimizer step: "
                f"torch.backends.cuda.matmul.allow_tf32={flags['matmul_allow_tf32']}, "
                f"torch.backends.cudnn.allow_tf32={flags['cudnn_allow_tf32']}, "
                f"torch.get_float32_matmul_precision()={flags['float32_matmul_precision']!r}",
                "flags": dict(flags),
            }
        if program is not None and program.args:
            profile["notes"].append(
                f"a {program.args_class or 'Trainer'} script timed by pitstop.watch / "
                "`pitstop profile -- COMMAND`: its own arguments, with the precision and "
                "accumulation the hooks observed"
            )
        else:
            profile["notes"].append(
                "a custom loop timed by pitstop.watch / `pitstop profile -- COMMAND`: its "
                "settings were observed and are written as the TrainingArguments fields the "
                "rules read"
            )
        return profile

    def _step_records(self) -> list[dict[str, Any]]:
        for s in self._steps:  # the losses were kept as tensors: reading them per step would sync
            losses = s.pop("loss_t", None)
            if losses:
                s["loss"] = sum(float(x) for x in losses) / len(losses)
        return super()._step_records()
