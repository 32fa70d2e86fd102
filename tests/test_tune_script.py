"""`pitstop tune -- CMD` (issue 31), the fast parts: the settings the boot hook applies, the
plan made from the doctor's findings, the verdict over baseline/candidate rounds, and the
whole search driven by a fake runner that writes synthetic run directories.

The end-to-end runs of real scripts are in tests/test_tune_script_e2e.py (slow).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pitstop.advise.finding import Finding
from pitstop.core.errors import DataError
from pitstop.core.process_group import TimeLimitReached
from pitstop.probe import DeviceInfo, cpu_has_bf16
from pitstop.tune import script_settings
from pitstop.tune.script import (
    BATCH,
    FAILED,
    FASTER,
    NOT_MEASURED,
    PRECISION,
    SAME,
    SAME_SPEED,
    SLOWER,
    TUNED,
    Round,
    format_script_report,
    judge,
    make_plan,
    tune_script,
)
from pitstop.tune.script_settings import (
    TrialSettings,
    loader_kwargs,
    split_batch,
    training_args_overrides,
)

CPU = DeviceInfo(type="cpu", name="AMD EPYC", bf16=cpu_has_bf16(frozenset({"avx2"})), cpu_count=2)
# A CPU whose (faked) flags have AVX-512 BF16: native bf16, as the doctor's probe reads flags.
CPU_BF16 = DeviceInfo(
    type="cpu", name="Xeon", bf16=cpu_has_bf16(frozenset({"avx512_bf16"})), cpu_count=2
)

INPUT_BOUND = Finding(
    id="input-bound",
    severity="high",
    title="steps wait for data 65.1% of the time",
    evidence={"workers_needed": 3},
    effect="up to 65.1% shorter steps",
    basis="measured in this profile",
    fix="DataLoader(..., num_workers=1, pin_memory=True, persistent_workers=True); "
    "cheaper batches still: tokenize/pre-process before training",
    gain=0.651,
    gain_measured=True,
)


# --- settings applied from outside -----------------------------------------------------------


def test_loader_overrides_and_worker_only_arguments() -> None:
    given = {"batch_size": 1, "num_workers": 0, "shuffle": True}
    out = loader_kwargs(given, {"num_workers": 2, "persistent_workers": True})
    assert out == {"batch_size": 1, "num_workers": 2, "shuffle": True, "persistent_workers": True}
    # Back to 0 workers: DataLoader rejects persistent_workers / prefetch_factor without them.
    out = loader_kwargs({"num_workers": 4, "prefetch_factor": 4}, {"num_workers": 0})
    assert out["persistent_workers"] is False and out["prefetch_factor"] is None


def test_dataloader_patch_in_process(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    settings = TrialSettings(str(tmp_path), 1000, loader={"num_workers": 1, "prefetch_factor": 3})
    script_settings.apply(settings)
    try:
        dl = DataLoader(list(range(8)), 2, True)  # positional arguments are bound too
        assert dl.num_workers == 1 and dl.prefetch_factor == 3 and dl.batch_size == 2
    finally:
        script_settings.remove()
    assert DataLoader(list(range(8)), batch_size=2).num_workers == 0  # the patch is gone
    applied = json.loads((tmp_path / script_settings.APPLIED).read_text())
    assert applied["loaders"] == 1 and applied["loader"]["num_workers"] == 1


def test_batch_split_keeps_the_product() -> None:
    assert split_batch(2, 8, 4) == (4, 4)
    assert split_batch(2, 8, 16) == (16, 1)
    assert split_batch(2, 8, 3) is None  # 16 rows do not split into micro-batches of 3


def test_training_args_overrides_refuse_and_force_safety(tmp_path: Path) -> None:
    current = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 8, "fp16": True}
    s = TrialSettings(
        str(tmp_path),
        12,
        training_args={"per_device_train_batch_size": 4, "bf16": True, "tf32": True},
        bf16_native=False,
    )
    fields, refused = training_args_overrides(current, s, cuda=False)
    assert fields["per_device_train_batch_size"] == 4 and fields["gradient_accumulation_steps"] == 4
    assert "bf16" not in fields and "native bf16" in refused["bf16"]
    assert "tf32" not in fields and "CUDA" in refused["tf32"]
    assert fields["save_strategy"] == "no" and fields["push_to_hub"] is False
    assert fields["report_to"] == "none" and fields["max_steps"] == 12
    assert Path(fields["output_dir"]).is_relative_to(tmp_path)
    s.bf16_native = True
    fields, refused = training_args_overrides(current, s, cuda=False)
    assert fields["bf16"] is True and fields["fp16"] is False and "bf16" not in refused
    s.training_args = {"per_device_train_batch_size": 3}
    fields, refused = training_args_overrides(current, s, cuda=False)
    assert (
        "per_device_train_batch_size" not in fields
        and "16" in refused["per_device_train_batch_size"]
    )


def test_training_args_patch_keeps_the_users_output_dir_untouched(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    user = tmp_path / "user_out"
    trial = tmp_path / "trial"
    s = TrialSettings(
        str(trial),
        7,
        training_args={"gradient_checkpointing": False, "dataloader_num_workers": 2},
    )
    script_settings.apply(s)
    try:
        args = TrainingArguments(
            output_dir=str(user),
            save_strategy="steps",
            save_steps=1,
            gradient_checkpointing=True,
            report_to=["tensorboard"],
            push_to_hub=False,
            use_cpu=True,
        )
    finally:
        script_settings.remove()
    assert Path(args.output_dir).is_relative_to(trial) and args.max_steps == 7
    assert getattr(args.save_strategy, "value", None) == "no" and args.report_to in (
        [],
        ["none"],
        "none",
    )
    assert args.gradient_checkpointing is False and args.dataloader_num_workers == 2
    assert not user.exists()
    applied = json.loads((trial / script_settings.APPLIED).read_text())
    assert applied["trainer"] and applied["script_args"]["gradient_checkpointing"] is True
    # Removed: the script's own values stand again.
    again = TrainingArguments(output_dir=str(user), use_cpu=True, report_to="none")
    assert again.output_dir == str(user)


# --- the plan ----------------------------------------------------------------------------------


def test_plain_loop_plan_names_dataloader_arguments() -> None:
    plan = make_plan([INPUT_BOUND], {"dataloader_num_workers": 0}, None, CPU)
    assert plan.kind == "loop"
    names = [c.name for c in plan.candidates]
    # The doctor's count (1: the cores it sees), and the count that would hide the load.
    assert names == ["num_workers=1", "num_workers=3"]
    c = plan.candidates[0]
    assert c.loader == {"num_workers": 1, "persistent_workers": True} and c.math == SAME
    assert c.predicted.startswith("up to 2.87x")  # 1 / (1 - 0.651)
    skipped = {n.fix: n.reason for n in plan.not_tried}
    assert "only its author" in skipped["tokenize / pre-process before training"]
    assert "no native bf16" in skipped["bf16"]


def test_trainer_plan_bf16_only_with_native_bf16() -> None:
    script = {
        "gradient_checkpointing": True,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 4,
        "bf16": False,
        "fp16": False,
    }
    padding = Finding("padding-waste", "medium", "padding", {}, "x", "computed from the data", "y")
    plan = make_plan([INPUT_BOUND, padding], {}, script, CPU_BF16)
    by = {c.name: c for c in plan.candidates}
    assert by["bf16=True"].math == PRECISION
    assert by["gradient_checkpointing=False"].math == SAME
    assert by["per_device_train_batch_size=4"].training_args == {"per_device_train_batch_size": 4}
    assert by["dataloader_num_workers=1"].training_args["dataloader_num_workers"] == 1
    assert "tf32=True" not in by  # CUDA only
    assert "group_by_length=True" not in by  # a batch change, not asked for
    assert any(n.fix == "group_by_length=True" for n in plan.not_tried)
    allowed = make_plan([padding], {}, script, CPU_BF16, allow_batch_changes=True)
    assert any(c.math == BATCH for c in allowed.candidates)
    # TRL's SFTConfig: packing changes the step, so it is tried only when asked.
    trl = {**script, "packing": False, "padding_free": False}
    assert "packing=True" not in [c.name for c in make_plan([], {}, trl, CPU).candidates]
    asked = make_plan([], {}, trl, CPU, allow_batch_changes=True)
    assert [c.math for c in asked.candidates if c.name == "packing=True"] == [BATCH]
    # The same script on a CPU without native bf16 (faked flags): bf16 is not tried.
    plain = make_plan([], {}, script, CPU)
    assert "bf16=True" not in [c.name for c in plain.candidates]
    assert any(n.fix == "bf16" and "no native bf16" in n.reason for n in plain.not_tried)


# --- the verdict -------------------------------------------------------------------------------


def _round(ratio: float, half: float = math.log1p(0.02)) -> Round:
    return Round(100.0, 100.0 * ratio, half)


def test_judge_separates_pools_and_keeps_noise() -> None:
    assert judge([_round(1.6)] * 2, 0.02).verdict == FASTER
    assert judge([_round(0.7)] * 2, 0.02).verdict == SLOWER
    # One pair is never enough for a verdict (both its runs may fall in a burst of load).
    assert judge([_round(1.6)], 0.02).verdict == SAME_SPEED
    j = judge([_round(1.01), _round(0.99)], 0.02)
    assert j.verdict == SAME_SPEED and j.low < 1 < j.high
    j = judge([_round(1.5), _round(1.6)], 0.02)
    assert j.ratio == pytest.approx(math.sqrt(1.5 * 1.6)) and j.verdict == FASTER
    # Pairs that disagree by much widen the band past 1.
    assert judge([_round(1.5), _round(1.02)], 0.02).verdict == SAME_SPEED
    # Seen on the shared 2-core machine: two pairs whose candidate runs both fell in bursts
    # of other processes' load (0.33x and 0.73x, each pair's own band narrow). Two pairs
    # that far apart say the noise is large, not that the fix slows the loop.
    assert judge([_round(0.33, 0.3), _round(0.73, 0.3)], 0.02).verdict == SAME_SPEED
    assert judge([_round(1.9), _round(2.1)], 0.02).verdict == FASTER  # pairs that agree


@pytest.mark.parametrize("true_ratio", [1.5, 0.7])
def test_a_busy_round_never_flips_the_verdict(true_ratio: float) -> None:
    quiet = judge([_round(true_ratio)] * 2, 0.02).verdict
    assert quiet == (FASTER if true_ratio > 1 else SLOWER)
    # A busy loop on one core slows one run of one round 2.5x: the candidate (when it is
    # faster) or the baseline (when it is slower), the way that pushes the ratio across 1.
    slowed = true_ratio / 2.5 if true_ratio > 1 else true_ratio * 2.5
    noisy = math.log1p(0.05)  # the round's runs are flagged noisy: compare's wider floor
    for rounds in (
        [_round(true_ratio), _round(slowed, noisy)],
        [_round(slowed, noisy), _round(true_ratio), _round(true_ratio)],
    ):
        got = judge(rounds, 0.02).verdict
        assert got in (quiet, SAME_SPEED), (rounds, got)


# --- the search, with a fake runner -------------------------------------------------------------


def _write_run(run_dir: Path, step_s: float, findings: list[Finding], config: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines, cum = [], 0
    for i in range(1, 13):
        cum += 100
        s = step_s * (1 + 0.01 * (i % 3))  # a little spread, as real steps have
        lines.append(
            {
                "step": i,
                "warmup": i <= 2,
                "trained_tokens": cum,
                "step_trained_tokens": 100,
                "step_seconds": s,
                "forward_s": s,
            }
        )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = {
        "status": "completed",
        "source": "script",
        "trained_tokens": cum,
        "optimizer_steps": 12,
        "train_seconds": 12 * step_s,
        "machine": {"load_average_1m": 0.1, "cpu_cores": 2},
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    profile = {"config": config, "device": CPU.to_dict()}
    (run_dir / "pitstop_profile.json").write_text(json.dumps(profile))
    (run_dir / "findings.json").write_text(
        json.dumps({"findings": [f.to_dict() for f in findings]})
    )


def _fake_runner(speed: dict[int, float], fail: set[int] = frozenset()) -> object:
    """A runner whose step time depends on the trial's num_workers (base 1.0 s)."""
    calls: list[TrialSettings] = []

    def run(
        command: list[str], run_dir: Path, settings: TrialSettings, warmup: int, seconds: float
    ) -> int:
        calls.append(settings)
        k = int(settings.loader.get("num_workers") or 0)
        if k in fail:
            run_dir.mkdir(parents=True)
            return 1  # an exception under this setting
        _write_run(run_dir, speed.get(k, 1.0), [INPUT_BOUND], {"dataloader_num_workers": 0})
        return 0

    run.calls = calls  # type: ignore[attr-defined]
    return run


def test_search_finds_the_loader_fix_and_prints_dataloader_arguments(tmp_path: Path) -> None:
    runner = _fake_runner({0: 1.0, 1: 0.5, 3: 0.4})
    rep = tune_script(["python", "train.py"], tmp_path / "t", runner, device=CPU)
    by = {r.candidate.name: r for r in rep.results}
    assert by["num_workers=1"].verdict == FASTER
    assert by["num_workers=1"].judgement.ratio == pytest.approx(2.0, rel=0.02)
    assert by["num_workers=3"].judgement.ratio == pytest.approx(2.5, rel=0.02)
    assert [w.candidate.name for w in rep.winners] == ["num_workers=3"]  # one per group
    assert by["num_workers=3"].judgement.low > 1.0  # the gain, outside the band
    assert rep.combined is by["num_workers=3"] and rep.combined.verdict == FASTER
    text = format_script_report(rep)
    assert "DataLoader(..., num_workers=3, persistent_workers=True)" in text
    assert "winning settings" in text
    saved = json.loads((tmp_path / "t" / TUNED).read_text())
    assert saved["dataloader_kwargs"] == {"num_workers": 3, "persistent_workers": True}
    assert saved["combined"]["verdict"] == FASTER
    # Every trial is a run directory compare reads.
    from pitstop.report.compare import compare

    assert compare(rep.baseline, by["num_workers=1"].runs[1])["metrics"]


def test_nothing_helps_says_no_change_beats_the_noise(tmp_path: Path) -> None:
    # A loader that costs nothing (issue 45: not a real search on a shared machine, where a
    # third worker was once measured faster): the workers the doctor proposes are measured,
    # and none beats the noise.
    runner = _fake_runner({0: 1.0, 1: 1.005, 3: 0.995})
    rep = tune_script(["python", "train.py"], tmp_path / "t", runner, device=CPU)
    assert [r.candidate.name for r in rep.results] == ["num_workers=1", "num_workers=3"]
    assert all(r.verdict == SAME_SPEED for r in rep.results)
    assert all(len(r.rounds) == 3 for r in rep.results)  # kept alternating: no separation
    assert "no change beats the noise" in format_script_report(rep)
    assert not rep.winners and rep.combined is None
    saved = json.loads((tmp_path / "t" / TUNED).read_text())
    assert saved["dataloader_kwargs"] == {} and saved["combined"] is None


def test_a_failing_trial_is_reported_and_the_search_goes_on(tmp_path: Path) -> None:
    runner = _fake_runner({0: 1.0, 3: 0.5}, fail={1})
    rep = tune_script(["python", "train.py"], tmp_path / "t", runner, device=CPU)
    by = {r.candidate.name: r for r in rep.results}
    assert by["num_workers=1"].verdict == FAILED and "status 1" in by["num_workers=1"].error
    assert by["num_workers=3"].verdict == FASTER
    assert "failed: the trial exited with status 1" in format_script_report(rep)


def test_budget_stops_the_search(tmp_path: Path) -> None:
    runner = _fake_runner({0: 1.0, 1: 1.0, 3: 1.0})
    rep = tune_script(
        ["python", "train.py"], tmp_path / "t", runner, device=CPU, budget_seconds=1e-6
    )
    assert len(runner.calls) <= 2  # the baseline and at most the trial that reuses it
    assert any(r.verdict.startswith("not measured") for r in rep.results)


def test_a_baseline_stopped_by_the_budget_names_the_stall(tmp_path: Path) -> None:
    # The runner stops a trial still running when the budget is spent (commands/tune.py:
    # launch.run_command with the budget left); the baseline had no optimizer step.
    def stalled(command: list[str], run_dir: Path, settings, warmup: int, seconds: float) -> int:
        run_dir.mkdir(parents=True)
        raise TimeLimitReached(seconds, "stopped it (SIGTERM to its process group)")

    with pytest.raises(DataError) as e:
        tune_script(["python", "train.py"], tmp_path / "t", stalled, budget_seconds=20)
    msg = str(e.value)
    assert "the baseline ran 20 s without an optimizer step (the budget)" in msg
    assert "stopped it (SIGTERM to its process group)" in msg and "--budget-seconds" in msg
    assert not (tmp_path / "t" / TUNED).exists()  # as for a failed baseline: no results


def test_a_trial_stopped_by_the_budget_keeps_what_was_measured(tmp_path: Path) -> None:
    runner = _fake_runner({0: 1.0, 1: 0.5, 3: 0.4})

    def stalls_on_three(
        command: list[str], run_dir: Path, settings: TrialSettings, warmup: int, seconds: float
    ) -> int:
        if settings.loader.get("num_workers") == 3:
            (run_dir).mkdir(parents=True)
            raise TimeLimitReached(seconds, "stopped it (SIGTERM to its process group)")
        return runner(command, run_dir, settings, warmup, seconds)

    rep = tune_script(["python", "train.py"], tmp_path / "t", stalls_on_three, device=CPU)
    by = {r.candidate.name: r for r in rep.results}
    assert by["num_workers=1"].verdict == FASTER and not by["num_workers=3"].error
    assert by["num_workers=3"].verdict == NOT_MEASURED
    saved = json.loads((tmp_path / "t" / TUNED).read_text())  # the best so far, written
    assert saved["dataloader_kwargs"] == {"num_workers": 1, "persistent_workers": True}


def test_a_baseline_that_exits_0_without_a_step_says_so(tmp_path: Path) -> None:
    def no_step(command: list[str], run_dir: Path, settings, warmup: int, seconds: float) -> int:
        run_dir.mkdir(parents=True)
        return 0  # `ls -la`, or a script that never trains

    with pytest.raises(DataError) as e:
        tune_script(["ls", "-la"], tmp_path / "t", no_step)
    assert "ran no optimizer step that pitstop could see" in str(e.value)
    assert "failed" not in str(e.value) and "exit status 0)" in str(e.value)


def test_cli_dry_run_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    from pitstop import cli

    assert cli.main(["tune", "--dry-run", "--", "python", "train.py"]) == 0
    out = capsys.readouterr().out
    assert "dry run" in out and "save_strategy='no'" in out and "guard them" in out


def test_cli_refuses_mixed_forms(capsys: pytest.CaptureFixture[str]) -> None:
    from pitstop import cli

    # Training flags belong to the command after --; --steps belongs to the script form.
    assert cli.main(["tune", "--lr", "1e-3", "--", "python", "train.py"]) == 2
    assert "training flags configure a pitstop run" in capsys.readouterr().err
    assert cli.main(["tune", "--steps", "5"]) == 2
    assert "only with -- COMMAND" in capsys.readouterr().err
    assert cli.main(["tune", "--steps", "2", "--", "python", "train.py"]) == 2
    assert "at least 4" in capsys.readouterr().err
