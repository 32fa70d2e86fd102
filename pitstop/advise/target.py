"""The machine and run a setup is audited for, when it is not this machine.

Users write a TrainingArguments / SFTConfig or pitstop config on a laptop and rent the
GPU later. `doctor --gpu H100 --nproc 2 --lora-r 16 --transformers-version 4.41.2`
judges the rules for that target: its device (from the GPU catalogue,
pitstop/catalog/gpus.py: capability, bf16, memory), the number of processes, whether only
LoRA adapters train (and whether the base is 4-bit), and the transformers release the run
will use.
Without any of these flags the target is this machine, as before.

A GPU target's CPU core count is unknown unless `--cpus` gives it (0 in `DeviceInfo`
means unknown); the worker rules then suggest pitstop's cap instead of reading this
machine's cores.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, TypedDict

from pitstop.advise.setup import Setup
from pitstop.core.errors import ConfigError
from pitstop.probe import DeviceInfo


class TargetRecord(TypedDict):
    """A Target as the doctor's report holds it (`Target.to_dict`)."""

    device: dict[str, Any]  # DeviceInfo.to_dict()
    nproc: int
    lora_r: int | None
    load_in_4bit: bool
    transformers: str | None
    given: bool


@dataclass(frozen=True)
class Target:
    """What the rules judge: a device, a process count, LoRA/4-bit, a transformers release."""

    device: DeviceInfo
    nproc: int = 1
    lora_r: int | None = None
    load_in_4bit: bool = False
    transformers: str | None = None  # None: the installed release
    given: bool = False  # any target flag was given (else this machine, as probed)

    def describe(self, local: DeviceInfo | None = None) -> str:
        """'audited for 1 × H100 (79.1 GiB), LoRA r=16, transformers 4.41.2 (this machine: …)'."""
        d = self.device
        mem = f", {d.total_memory_bytes / 2**30:.1f} GiB" if d.total_memory_bytes else ""
        what = [f"{self.nproc} × {d.name}{mem}"]
        if self.lora_r is not None:
            what.append(f"{'QLoRA (4-bit base)' if self.load_in_4bit else 'LoRA'} r={self.lora_r}")
        if self.transformers:
            what.append(f"transformers {self.transformers}")
        text = "audited for " + ", ".join(what)
        if local is not None:
            text += f" (this machine: {_machine(local)})"
        return text

    def to_dict(self) -> TargetRecord:
        return TargetRecord(
            device=self.device.to_dict(),
            nproc=self.nproc,
            lora_r=self.lora_r,
            load_in_4bit=self.load_in_4bit,
            transformers=self.transformers,
            given=self.given,
        )

    def apply(self, setup: Setup) -> Setup:
        """The setup as it will run on the target (processes, adapters, field names)."""
        if not self.given:
            return setup
        changes: dict[str, Any] = {}
        if self.nproc != 1 or setup.source == "hf":  # HF files do not say how many processes
            changes["world"] = self.nproc
        if self.lora_r is not None:
            changes["lora"] = True
            changes["lora_r"] = self.lora_r
            changes["load_in_4bit"] = self.load_in_4bit
        major = _major(self.transformers)
        if major is not None:
            changes["transformers_major"] = major
        return replace(setup, **changes)


def _machine(dev: DeviceInfo) -> str:
    if dev.type == "cpu":
        return f"{dev.cpu_count}-core CPU"
    return f"{dev.name}"


def _major(version: str | None) -> int | None:
    head = (version or "").split(".")[0]
    return int(head) if head.isdigit() else None


def make_target(
    local: DeviceInfo,
    *,
    gpu: str | None = None,
    nproc: int | None = None,
    cpus: int | None = None,
    lora_r: int | None = None,
    load_in_4bit: bool = False,
    transformers_version: str | None = None,
) -> Target:
    """The target from the doctor's flags; this machine where a flag is absent."""
    problems = []
    if nproc is not None and nproc < 1:
        problems.append(f"--nproc must be 1 or more, got {nproc}")
    if cpus is not None and cpus < 1:
        problems.append(f"--cpus must be 1 or more, got {cpus}")
    if lora_r is not None and lora_r < 1:
        problems.append(f"--lora-r must be 1 or more, got {lora_r}")
    if load_in_4bit and lora_r is None:
        problems.append(
            "--load-in-4bit trains a LoRA adapter on frozen 4-bit weights; add --lora-r R"
        )
    if transformers_version is not None and _major(transformers_version) is None:
        problems.append(
            f"--transformers-version must look like 4.41.2, got {transformers_version!r}"
        )
    device = local
    if gpu:
        from pitstop.report.gpus import get_gpu

        try:
            g = get_gpu(gpu)
        except ConfigError as e:
            problems += e.problems
        else:
            assert g.spec is not None  # get_gpu returns catalogue cards only
            device = DeviceInfo(
                type="cuda",
                name=g.name,
                # Looked up by exact name or alias (never by prefix), so "L40" is not the L4;
                # None for a card that is not a CUDA device (the capability rules stay quiet).
                capability=g.spec.capability,
                bf16=g.bf16,
                total_memory_bytes=g.memory_bytes,
                cpu_count=cpus or 0,  # unknown for a rented machine unless given
            )
    elif cpus:
        device = replace(local, cpu_count=cpus)
    if problems:
        raise ConfigError(problems, header=f"invalid target ({len(problems)} problem(s)):")
    given = any(
        x is not None and x is not False
        for x in (gpu, nproc, cpus, lora_r, transformers_version, load_in_4bit or None)
    )
    return Target(
        device=device,
        nproc=nproc or 1,
        lora_r=lora_r,
        load_in_4bit=load_in_4bit,
        transformers=transformers_version,
        given=given,
    )
