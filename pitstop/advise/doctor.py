"""`doctor`: environment + setup + data + profile -> ranked findings.

The setup is a pitstop RunConfig, Hugging Face TrainingArguments / SFTConfig
fields (a plain mapping), or, when neither is given, the config recorded in the
profile. The device the rules judge is the profile's (where the run was measured)
when there is one, else this machine's.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, TypedDict

from pitstop.advise.environment import Environment
from pitstop.advise.environment import environment as probe_environment
from pitstop.advise.facts import DataFacts, data_facts_from_store, model_facts
from pitstop.advise.finding import Finding, FindingRecord, rank, reported
from pitstop.advise.hf_args import class_reason, classify_fields, from_hf_args
from pitstop.advise.rules import Context, run_rules
from pitstop.advise.setup import Setup, from_run_config, is_custom_loop
from pitstop.advise.target import Target, TargetRecord
from pitstop.core import log, run_record
from pitstop.core.cache_layout import cache_root
from pitstop.core.config import FIELDS, RunConfig
from pitstop.core.errors import ConfigError
from pitstop.data.prepare import prepare_data
from pitstop.data.store import is_store
from pitstop.measure.peak import model_precision_speed, profile_precision_speed
from pitstop.measure.verdict import Profile, VerdictRecord
from pitstop.measure.verdict import verdict as profile_verdict
from pitstop.probe import Choice, DeviceInfo, PrecisionSpeed, choose_precision, cpu_bf16_candidate


class PrecisionChoice(TypedDict):
    value: str
    reason: str


class AuditedSetup(TypedDict, total=False):
    """What the doctor judged: the setup's kind, the device, the precision it would train in."""

    source: str
    hf_class: str | None
    device: dict[str, Any]  # DeviceInfo.to_dict()
    precision: PrecisionChoice
    hf_class_reason: str  # Hugging Face arguments only


class FieldCheck(TypedDict):
    unknown: list[str]  # fields no TrainingArguments class has, with a did-you-mean
    not_checked: list[str]  # known fields no rule checks


class _Report(TypedDict):
    environment: Environment
    findings: list[FindingRecord]
    verdict: VerdictRecord | None
    setup: AuditedSetup
    target: TargetRecord | None
    audited_for: str | None


class DoctorReport(_Report, total=False):
    """`doctor`'s result: what `doctor --json` prints and findings.json holds."""

    fields: FieldCheck  # Hugging Face arguments only


def device_from_dict(d: dict[str, Any] | None) -> DeviceInfo | None:
    """A DeviceInfo from its `to_dict()` (as stored in profiles and environment reports)."""
    if not d or "type" not in d:
        return None
    cap = d.get("capability")
    return DeviceInfo(
        type=str(d["type"]),
        name=str(d.get("name", "")),
        capability=tuple(cap) if cap else None,  # type: ignore[arg-type]
        bf16=bool(d.get("bf16", False)),
        total_memory_bytes=d.get("total_memory_bytes"),
        cpu_count=int(d.get("cpu_count") or 1),
        index=int(d.get("index") or 0),
    )


def planned_precision(
    setup: Setup,
    device: DeviceInfo,
    *,
    here: bool,
    model_dir: str | Path | None,
    cache_dir: str | Path | None,
    profile: Profile | None = None,
) -> tuple[Choice, PrecisionSpeed | None]:
    """The precision `pitstop train` would train this setup with, and the measurement behind it.

    On a CPU with native bf16, `--precision auto` is decided by timing fp32 against bf16
    autocast at the model's matmul shapes. The doctor reads the same cache entry training
    writes (or measures it, ~0.2 s, and caches it for the run), so both say the same thing.
    Only where the audit is for this machine as probed (`here`): a target machine, a
    pretended device or a profile's device is not timed on this one.
    """
    if setup.precision == "fp32" and here and profile and device.type == "cpu" and device.bf16:
        # A profiled fp32 run on a CPU with native bf16: what bf16 would give it, measured
        # at its model's shapes (the precision finding's prediction).
        return Choice("fp32", "as run"), profile_precision_speed(cache_dir, profile)
    if setup.precision != "auto":  # as configured (a rule reports one the device cannot run)
        return Choice(setup.precision, "as configured"), None
    measured = None
    wanted = here and setup.source == "pitstop" and cpu_bf16_candidate(setup.precision, device)
    if wanted and model_dir is not None and setup.max_len:
        measured = model_precision_speed(cache_dir, model_dir, setup.max_len)
    return choose_precision(setup.precision, device, measured), measured


def profile_mismatch(
    profile: dict[str, Any] | None, device: DeviceInfo, model: str | Path | None
) -> str | None:
    """Why a profile does not measure the audited target (another device or model), or None.

    A profile measured on a laptop's CPU says nothing measured about an H100: its step
    shares, its peak memory and its rate belong to the machine and model it ran on.
    """
    if not profile:
        return None
    ran = device_from_dict(profile.get("device"))
    if ran is not None and not _same_device(ran, device):
        where = f"{ran.type} ({ran.name})" if ran.name else ran.type
        return f"the profile ran on {where}, the audit is for {device.name or device.type}"
    cfg = profile.get("config") if isinstance(profile.get("config"), dict) else {}
    ran_model = cfg.get("model") if isinstance(cfg.get("model"), str) else None
    if model and ran_model and Path(ran_model).resolve() != Path(model).resolve():
        return f"the profile trained {ran_model}, the audit is for {model}"
    return None


def _same_device(a: DeviceInfo, b: DeviceInfo) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True  # a CPU profile audits the CPU it ran on (names vary by probe)
    from pitstop.report.gpus import find_gpu

    ga, gb = find_gpu(a.name), find_gpu(b.name)
    return ga == gb if ga is not None and gb is not None else a.name == b.name


def foreign_profile_finding(why: str, profile: dict[str, Any]) -> Finding:
    """The note that a profile was set aside: its numbers are not the target's."""
    v = profile_verdict(profile)
    return Finding(
        id="profile-other-target",
        severity="medium",
        title="the profile does not measure the audited target: its numbers are not used",
        evidence={
            "why": why,
            "profile_device": profile.get("device"),
            "profile_verdict": v.kind if v is not None else None,
        },
        effect=f"{why}; step shares, peak memory and rates measured there do not carry over, "
        "so no finding below is based on them (the verdict printed above is the profile's "
        "own machine's)",
        basis="measured in this profile",
        fix="profile the run on the target (`pitstop profile`, or PitstopCallback in the "
        "Trainer) and pass that profile; or audit without --gpu for the profile's machine",
        gain=0.0,
    )


def run_config_from_dict(d: dict[str, Any]) -> RunConfig:
    """A RunConfig from a stored dict (a profile's "config"), ignoring unknown keys."""
    return RunConfig(**{k: v for k, v in d.items() if k in FIELDS})


def make_setup(
    config: RunConfig | None = None,
    hf_args: dict[str, Any] | None = None,
    hf_class: str = "auto",
    profile: dict[str, Any] | None = None,
) -> Setup:
    if config is not None and hf_args is not None:
        raise ConfigError("give a pitstop config or Hugging Face arguments, not both")
    if config is not None:
        return from_run_config(config)
    profile = profile or {}
    recorded = profile.get("config") if isinstance(profile.get("config"), dict) else None
    if hf_args is not None and (not recorded or hf_args != recorded):
        return from_hf_args(hf_args, hf_class)  # a declared file: its omitted fields default
    observed = profile.get("source") in (run_record.SOURCE_HF, run_record.SOURCE_SCRIPT)
    if recorded and (hf_args is not None or observed):
        # The profile's own record (PitstopCallback passes it back as hf_args): what the run
        # did not record stays unknown; a TrainingArguments default would describe another run.
        setup = from_hf_args(recorded, hf_class, recorded=True)
        program = profile.get("program") if isinstance(profile.get("program"), str) else None
        return replace(setup, custom_loop=is_custom_loop(profile), program=program)
    if recorded:
        return from_run_config(run_config_from_dict(recorded))
    return from_run_config(RunConfig())


def load_data_facts(
    path: str | Path,
    *,
    model: str | Path | None = None,
    max_seq_len: int | None = None,
    cache_dir: str | Path | None = None,
) -> DataFacts:
    """Length facts of a token store, or of a dataset file prepared with the model's tokenizer."""

    if is_store(path):
        return data_facts_from_store(path)
    if not Path(path).exists():
        raise ConfigError(f"--data {path} does not exist")
    if not model:
        raise ConfigError(
            f"--data {path} is a dataset file; give --model DIR so its tokenizer can count the "
            "tokens, or give a prepared token store (`pitstop prepare`)"
        )
    cfg = RunConfig(
        data=[str(path)], model=str(model), cache_dir=str(cache_dir) if cache_dir else None
    )
    if max_seq_len:
        cfg.max_seq_len = max_seq_len
    prepared = prepare_data(cfg, progress=False)
    facts = data_facts_from_store(prepared.store_path)
    if not facts.stats:
        facts.stats = dict(prepared.stats or {})
    return facts


def doctor(
    *,
    config: RunConfig | None = None,
    hf_args: dict[str, Any] | None = None,
    hf_class: str = "auto",
    model: str | Path | None = None,
    data: DataFacts | str | Path | None = None,
    profile: dict[str, Any] | None = None,
    baseline: RunConfig | dict[str, Any] | None = None,
    environment: Environment | None = None,
    device: DeviceInfo | None = None,
    cache_dir: str | Path | None = None,
    compile_check: bool = True,
    disk_check: bool = True,
    target: Target | None = None,
    progress: bool = False,
    measured_here: bool = False,
) -> DoctorReport:
    """Audit a setup; returns {"environment", "findings", "verdict", "setup", "fields", "target"}.

    `device` pretends a machine (tests); `environment` skips the probe when given.
    `baseline` (a RunConfig or HF mapping of the same kind) enables the effective-batch check.
    `target` (pitstop.advise.target) judges the rules for another machine and run: its
    device, process count, LoRA/4-bit and transformers release; the report says so.
    `progress` prints a line to stderr before steps that can take seconds (preparing --data).
    `measured_here`: the profile was measured on this machine, in this process (the Trainer
    callback and the watch), so what depends on the machine may be measured now.
    """
    setup = make_setup(config, hf_args, hf_class, profile)
    if target is not None:
        setup = target.apply(setup)
    probed_here = environment is None and device is None
    if environment is None:
        data_path = data if isinstance(data, (str, Path)) else None
        environment = probe_environment(
            data=data_path if disk_check else None,
            loader_workers=setup.loader_workers,
            cache_dir=cache_dir,
            compile_check=compile_check,
            device=device,
        )
    this_machine = device_from_dict(environment.get("device")) if probed_here else None
    local = (
        device_from_dict((profile or {}).get("device"))
        or device
        or this_machine
        or DeviceInfo(type="cpu", name="cpu")
    )
    dev = target.device if target is not None and target.given else local
    model_dir = model or (config.model if config is not None else None)
    facts = _data(data, config, setup, model_dir, cache_dir, progress)
    foreign = profile_mismatch(profile, dev, model_dir)
    precision, measured = planned_precision(
        setup,
        dev,
        here=(this_machine is not None and dev is this_machine) or measured_here,
        model_dir=model_dir,
        cache_dir=cache_root((config.cache_dir if config is not None else None) or cache_dir),
        profile=None if foreign else profile,
    )
    ctx = Context(
        setup=setup,
        device=dev,
        env=environment,
        data=facts,
        model=model_facts(model_dir),
        profile=None if foreign else profile,
        baseline=_baseline(baseline, hf_class, target),
        transformers=target.transformers if target is not None else None,
        measured_precision=measured,
    )
    found = run_rules(ctx)
    if foreign and profile:
        found.append(foreign_profile_finding(foreign, profile))
    return _report(ctx, rank(reported(found)), precision, profile, target, local, hf_args, hf_class)


def _data(
    data: DataFacts | str | Path | None,
    config: RunConfig | None,
    setup: Setup,
    model_dir: str | Path | None,
    cache_dir: str | Path | None,
    progress: bool,
) -> DataFacts | None:
    """The data's length facts: a file or store given, else a pitstop config's one store."""
    if isinstance(data, (str, Path)):
        if progress:
            log.info(f"doctor: reading the lengths of {data} ...")
        return load_data_facts(
            data, model=model_dir, max_seq_len=setup.max_len, cache_dir=cache_dir
        )
    if data is None and config is not None and len(config.data) == 1 and is_store(config.data[0]):
        return data_facts_from_store(config.data[0])
    return data


def _baseline(
    baseline: RunConfig | dict[str, Any] | None, hf_class: str, target: Target | None
) -> Setup | None:
    """The setup the effective-batch check compares with, on the same target."""
    if baseline is None:
        return None
    base = (
        from_run_config(baseline)
        if isinstance(baseline, RunConfig)
        else from_hf_args(baseline, hf_class)
    )
    return target.apply(base) if target is not None else base  # both files run on the target


def _report(
    ctx: Context,
    findings: list[Finding],
    precision: Choice,
    profile: Profile | None,
    target: Target | None,
    local: DeviceInfo,
    hf_args: dict[str, Any] | None,
    hf_class: str,
) -> DoctorReport:
    setup = ctx.setup
    out = DoctorReport(
        environment=ctx.env,
        findings=[f.to_dict() for f in findings],
        verdict=profile_verdict(profile).to_dict() if profile else None,
        setup=AuditedSetup(
            source=setup.source,
            hf_class=setup.hf_class,
            device=ctx.device.to_dict(),
            precision=PrecisionChoice(value=precision.value, reason=precision.reason),
        ),
        target=target.to_dict() if target is not None else None,
        audited_for=target.describe(local) if target is not None and target.given else None,
    )
    if hf_args is not None:
        unknown, unchecked = classify_fields(hf_args)
        out["fields"] = FieldCheck(unknown=unknown, not_checked=unchecked)
        out["setup"]["hf_class_reason"] = class_reason(hf_args, hf_class)
    return out


def write_findings(report: DoctorReport, out_dir: str | Path) -> Path:
    """Write the report as OUT_DIR/findings.json (what `pitstop report` shows); its path."""
    d = Path(out_dir)
    if d.exists() and not d.is_dir():
        raise ConfigError(f"--output {d} is a file; give a directory (e.g. the run directory)")
    d.mkdir(parents=True, exist_ok=True)
    return run_record.write_findings(d, report)
