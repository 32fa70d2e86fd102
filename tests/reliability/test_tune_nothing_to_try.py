"""Issue 45: `pitstop tune -- CMD` with nothing to try says so, and why.

When the plan holds no candidate (the doctor found nothing in the baseline, or nothing it
found can be applied from outside the script), nothing is measured; the report used to end
with "no change beats the noise", a verdict about measurements that were never made. The
search is driven by a fake runner that writes the baseline's run directory, as in
tests/test_tune_script.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from pitstop.advise.finding import Finding
from pitstop.probe import DeviceInfo
from pitstop.tune.script import TUNED, format_script_report, tune_script

CPU = DeviceInfo(type="cpu", name="AMD EPYC", bf16=False, cpu_count=2)
# A finding no candidate answers: only the script's author can act on it.
ONLY_THE_AUTHOR = Finding(
    id="pitstop-test-unfixable",
    severity="medium",
    title="something only the script's author can change",
    evidence={},
    effect="-",
    basis="measured in this profile",
    fix="edit the script",
    gain=0.1,
    gain_measured=True,
)


def _runner(findings: list[Finding]):
    calls: list[Path] = []

    def run(command, run_dir: Path, settings, warmup: int, seconds: float) -> int:
        calls.append(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        lines = [{"step": i, "warmup": i <= 2, "trained_tokens": 100 * i,
                  "step_trained_tokens": 100, "step_seconds": 1.0, "forward_s": 1.0}
                 for i in range(1, 13)]  # fmt: skip
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        summary = {"status": "completed", "source": "script", "trained_tokens": 1200,
                   "optimizer_steps": 12, "train_seconds": 12.0,
                   "machine": {"load_average_1m": 0.1, "cpu_cores": 2}}  # fmt: skip
        (run_dir / "summary.json").write_text(json.dumps(summary))
        profile = {"config": {"dataloader_num_workers": 2}, "device": CPU.to_dict()}
        (run_dir / "pitstop_profile.json").write_text(json.dumps(profile))
        (run_dir / "findings.json").write_text(
            json.dumps({"findings": [f.to_dict() for f in findings]})
        )
        return 0

    run.calls = calls  # type: ignore[attr-defined]
    return run


def _check_nothing_measured(tmp_path: Path, findings: list[Finding]) -> str:
    runner = _runner(findings)
    rep = tune_script(["python", "train.py"], tmp_path / "t", runner, device=CPU)
    assert len(runner.calls) == 1  # the baseline alone: no trial ran
    assert rep.results == [] and rep.combined is None and not rep.winners
    text = format_script_report(rep)
    assert "beats the noise" not in text and "(measured:" not in text, text
    last = [ln for ln in text.splitlines() if ln.strip()][-2]  # before the where-to-look line
    assert last.startswith("nothing was tried: ") and last.endswith(
        "; keep the script's settings"
    ), text
    saved = json.loads((tmp_path / "t" / TUNED).read_text())
    assert saved["results"] == [] and saved["code"] == ""
    return last


def test_nothing_found_says_nothing_was_tried_and_why(tmp_path):
    last = _check_nothing_measured(tmp_path, [])
    assert "the doctor found nothing to change in the baseline run" in last


def test_nothing_applicable_says_nothing_was_tried_and_why(tmp_path):
    last = _check_nothing_measured(tmp_path, [ONLY_THE_AUTHOR])
    assert "no fix the doctor proposed can be applied from outside the script" in last
