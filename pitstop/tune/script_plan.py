"""`pitstop tune -- CMD`'s plan: the doctor's findings as settings applied from outside.

Each candidate is one setting `script_settings` can apply to an unchanged script, labelled
by what it does to the training math: DataLoader arguments for a plain loop, a
TrainingArguments / SFTConfig field for a Trainer script, the model's forward under bf16
autocast for a plain loop on a device with native bf16. A fix that cannot be applied from
outside (it lives in the script's code) is listed with the reason instead. The planner
reads the findings one kind at a time, in the order the plan lists them: loader workers,
precision, TF32, activation checkpointing, fused optimizer and compile, the micro-batch
split, then what changes which tokens form a step (length grouping, packing, padding-free).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pitstop.advise.finding import Finding
from pitstop.probe import DeviceInfo
from pitstop.tune.script_settings import Value

SAME = "same math"
PRECISION = "same math up to precision"
BATCH = "changes which tokens form a step"
ONLY_WHEN_ASKED = f"{BATCH}: tried only with --allow-batch-changes"


@dataclass
class Candidate:
    """One setting to try: what it sets, what it does to the math, what the doctor predicted."""

    name: str  # e.g. "num_workers=1"
    group: str  # candidates of one group exclude each other in the combination
    math: str  # SAME, PRECISION or BATCH
    loader: dict[str, Value] = field(default_factory=dict)
    training_args: dict[str, Value] = field(default_factory=dict)
    autocast: str | None = None  # a plain loop's model forward under this autocast dtype
    finding: str | None = None  # the doctor's finding id it answers
    predicted: str = "-"  # the doctor's predicted effect, short


@dataclass
class NotTried:
    """A fix the plan does not measure, and why."""

    fix: str
    reason: str


@dataclass
class Plan:
    kind: str  # "loop" (DataLoader arguments) or "trainer" (TrainingArguments fields)
    candidates: list[Candidate]
    not_tried: list[NotTried]


def short_prediction(effect: str, gain: float) -> str:
    """The doctor's predicted effect as a ratio where it is a share of step time."""
    if gain and 0 < gain < 1:
        return f"up to {1 / (1 - gain):.2f}x"
    m = re.match(r"[^:;(]{0,60}", effect or "")
    return (m.group(0).strip() if m else "") or "-"


def make_plan(
    findings: list[Finding],
    observed: dict[str, Value],
    script_args: dict[str, Value] | None,
    device: DeviceInfo,
    *,
    allow_batch_changes: bool = False,
) -> Plan:
    """Candidates for the baseline's findings and observed settings.

    `observed`: the profile's config (the loop's settings as TrainingArguments fields);
    `script_args`: the script's own TrainingArguments values (None for a plain loop);
    `device`: the device as the doctor saw it (tests pass a pretend one, e.g. a CPU whose
    flags lack avx512_bf16).
    """
    p = _Planner(findings, observed, script_args, device, allow_batch_changes)
    p.loader_workers()
    p.precision()
    p.tf32()
    p.checkpointing()
    p.optimizer_and_compile()
    p.micro_batch_split()
    p.rows_of_a_step()
    if p.cands == [] and not findings:
        p.skip.append(NotTried("anything", "the doctor found nothing to change"))
    return Plan("trainer" if p.trainer else "loop", p.cands, p.skip)


class _Planner:
    """The plan being built: the script's settings, the findings by id, and what is planned."""

    def __init__(
        self,
        findings: list[Finding],
        observed: dict[str, Value],
        script_args: dict[str, Value] | None,
        device: DeviceInfo,
        allow_batch_changes: bool,
    ) -> None:
        self.findings = findings
        self.trainer = script_args is not None
        self.script_args = script_args or {}
        self.cur = dict(observed) | dict(script_args or {})
        self.by_id = {f.id: f for f in findings}
        self.device = device
        self.cuda = device.type == "cuda"
        self.cores = device.cpu_count or 1
        self.allow = allow_batch_changes
        self.cands: list[Candidate] = []
        self.skip: list[NotTried] = []

    def predicted(self, fid: str) -> tuple[str | None, str]:
        f = self.by_id.get(fid)
        if f is None:
            return None, "-"
        return fid, short_prediction(f.effect, f.gain)

    def add(self, cand: Candidate, fid: str | None = None) -> None:
        if fid is not None:
            cand.finding, cand.predicted = self.predicted(fid)
        self.cands.append(cand)

    def loader_workers(self) -> None:
        """The doctor's worker count, and the count that would hide the load when the doctor
        held back for want of cores (a loader that waits, not computes, still gains)."""
        f = self.by_id.get("input-bound") or self.by_id.get("loader-main-process")
        if f is None:
            return
        workers = int(self.cur.get("dataloader_num_workers") or 0)
        counts = [int(k) for k in re.findall(r"num_workers[= ](\d+)", f.fix)]
        need = f.evidence.get("workers_needed")
        if isinstance(need, int):
            counts.append(need)
        # More workers than twice the cores is a guess no profile supports: capped there.
        cap = 2 * self.cores
        counts = sorted({min(k, cap) for k in counts if k > workers} or {max(1, workers + 1)})
        for k in counts[:2]:
            self.add(self._workers(k), f.id)
            if k >= self.cores:
                self.cands[-1].predicted += f" ({k} workers on {self.cores} cores)"
        if "tokeniz" in f.fix:
            self.skip.append(
                NotTried(
                    "tokenize / pre-process before training",
                    "changes the script's data pipeline: only its author can",
                )
            )

    def _workers(self, k: int) -> Candidate:
        if self.trainer:
            args: dict[str, Value] = {
                "dataloader_num_workers": k,
                "dataloader_persistent_workers": True,
            }
            if self.cuda:
                args["dataloader_pin_memory"] = True
            return Candidate(f"dataloader_num_workers={k}", "workers", SAME, training_args=args)
        kw: dict[str, Value] = {"num_workers": k, "persistent_workers": True}
        if self.cuda:
            kw["pin_memory"] = True  # page-locked host memory: a CUDA copy's gain only
        return Candidate(f"num_workers={k}", "workers", SAME, loader=kw)

    def precision(self) -> None:
        """bf16 where the device computes it natively: a Trainer's field, a loop's autocast."""
        cur = self.cur
        precision = "bf16" if cur.get("bf16") else "fp16" if cur.get("fp16") else "fp32"
        if precision == "bf16":
            return
        if not self.device.bf16:
            self.skip.append(
                NotTried(
                    "bf16",
                    f"{self.device.name} has no native bf16 (no avx512_bf16 / "
                    "amx_bf16 on a CPU, compute capability < 8.0 on a GPU): it "
                    "would be emulated, slower",
                )
            )
            return
        if not self.cuda:
            fid = "fp32-on-bf16-cpu"
        else:
            fid = "fp32-on-gpu" if precision == "fp32" else "fp16-on-bf16-gpu"
        if self.trainer:
            cand = Candidate("bf16=True", "precision", PRECISION, training_args={"bf16": True})
        else:  # the model's forward under bf16 autocast, applied from outside
            cand = Candidate("torch.autocast(bfloat16)", "precision", PRECISION, autocast="bf16")
        self.add(cand, fid)

    def tf32(self) -> None:
        if not self.cuda or self.cur.get("fp16") or self.cur.get("bf16") or self.cur.get("tf32"):
            return
        if self.trainer:
            self.add(Candidate("tf32=True", "tf32", PRECISION, training_args={"tf32": True}))
        else:
            self.skip.append(
                NotTried(
                    "tf32",
                    "set torch.backends.cuda.matmul.allow_tf32 = True in "
                    "the script (a plain loop has no field to set from outside)",
                )
            )

    def checkpointing(self) -> None:
        if not (self.cur.get("gradient_checkpointing") or self.cur.get("activation_checkpointing")):
            return
        if self.trainer:
            args: dict[str, Value] = {"gradient_checkpointing": False}
            self.add(
                Candidate(
                    "gradient_checkpointing=False", "checkpointing", SAME, training_args=args
                ),
                "gradient-checkpointing-unneeded",
            )
        else:
            self.skip.append(
                NotTried(
                    "gradient checkpointing off",
                    "the script turns it on in its "
                    "code (gradient_checkpointing_enable / torch.utils.checkpoint)",
                )
            )

    def optimizer_and_compile(self) -> None:
        if not self.trainer:
            return
        if "optimizer-not-fused" in self.by_id:
            args: dict[str, Value] = {"optim": "adamw_torch_fused"}
            self.add(
                Candidate("optim=adamw_torch_fused", "optim", SAME, training_args=args),
                "optimizer-not-fused",
            )
        if "compile-off" in self.by_id:
            args = {"torch_compile": True}
            self.add(
                Candidate("torch_compile=True", "compile", SAME, training_args=args), "compile-off"
            )

    def micro_batch_split(self) -> None:
        micro = int(self.cur.get("per_device_train_batch_size") or 1)
        accum = int(self.cur.get("gradient_accumulation_steps") or 1)
        if self.trainer and accum > 1 and accum % 2 == 0:
            args: dict[str, Value] = {"per_device_train_batch_size": micro * 2}
            cand = Candidate(f"per_device_train_batch_size={micro * 2}", "split", SAME)
            cand.training_args, cand.predicted = args, "fewer, larger micro-batches"
            self.add(cand)

    def rows_of_a_step(self) -> None:
        """Length grouping, TRL's packing and padding-free: each changes which tokens form a
        step (padding_free keeps the rows, but without packing TRL no longer enforces
        max_length, so rows longer than it train whole), so each is tried only when asked."""
        if not self.trainer:
            return
        padding = [
            f.id for f in self.findings if f.id.startswith("padding") or f.id == "packing-off"
        ]
        fid = padding[0] if padding else None
        fields: list[tuple[str, str, bool]] = []
        if padding and not self.cur.get("group_by_length"):
            fields.append(("group_by_length", "length", True))
        for name in ("packing", "padding_free"):
            if self.script_args.get(name) is False:
                fields.append((name, name, True))
        for name, group, value in fields:
            label = f"{name}={value}"
            if not self.allow:
                self.skip.append(NotTried(label, ONLY_WHEN_ASKED))
                continue
            cand = Candidate(label, group, BATCH, training_args={name: value})
            self.add(cand, fid)
