"""`pitstop compare --rerun N` (alternating reruns of two profiled commands) and the
`torchrun` launcher form of `pitstop profile -- ...`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pitstop.anyloop import rerun as rerun_mod
from pitstop.core.errors import ConfigError
from pitstop.report.compare import NO_DIFFERENCE
from tests.test_report_noise import synthetic_run

ROOT = Path(__file__).resolve().parents[1]
LOOP = ROOT / "tests" / "_linear_loop.py"


def with_command(run: Path, command: list[str]) -> Path:
    s = json.loads((run / "summary.json").read_text())
    s.update(command=command, command_cwd=str(run.parent), profile={"warmup_steps": 1})
    (run / "summary.json").write_text(json.dumps(s))
    return run


def test_settle_needs_every_pair_to_agree(tmp_path: Path) -> None:
    def pair(i: int, b_step: float) -> tuple[Path, Path]:
        a = synthetic_run(tmp_path / f"{i}a", jitter=0.02, seed=i)
        return a, synthetic_run(tmp_path / f"{i}b", step_s=b_step, jitter=0.02, seed=i + 50)

    agree = rerun_mod.settle([pair(1, 0.7), pair(2, 0.7)])
    assert agree["verdict"] == "better" and agree["median_ratio"] == pytest.approx(2.0, rel=0.1)
    mixed = rerun_mod.settle([pair(3, 0.7), pair(4, 1.4)])
    assert mixed["verdict"] == NO_DIFFERENCE
    assert "not every pair agrees" in rerun_mod.format_settle(mixed)


def test_rerun_alternates_a_and_b(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = with_command(synthetic_run(tmp_path / "a"), ["train", "--slow"])
    b = with_command(synthetic_run(tmp_path / "b", step_s=0.7), ["train"])
    calls = []

    def fake_run(command: list[str], output: Path, **kw: object) -> int:
        calls.append((command, kw["cwd"], kw["warmup_steps"]))
        shutil.copytree(a if "--slow" in command else b, output)
        return 0

    monkeypatch.setattr(rerun_mod, "run_command", fake_run)
    pairs = rerun_mod.rerun_pairs(a, b, 2, tmp_path / "re")
    assert [c[0] for c in calls] == [["train", "--slow"], ["train"]] * 2
    assert {c[1] for c in calls} == {str(tmp_path)} and {c[2] for c in calls} == {1}
    assert [p[0].name for p in pairs] == ["1-a", "2-a"]
    assert rerun_mod.settle(pairs)["verdict"] == "better"
    with pytest.raises(ConfigError, match="1 to 20"):
        rerun_mod.rerun_pairs(a, b, 0)


def test_a_run_without_a_command_cannot_be_rerun(tmp_path: Path) -> None:
    a, b = synthetic_run(tmp_path / "a"), synthetic_run(tmp_path / "b")
    with pytest.raises(ConfigError, match="records no command"):
        rerun_mod.rerun_pairs(a, b, 1)


def pitstop_cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "pitstop", *argv], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=400,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.long
def test_compare_rerun_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The CLI in this process (the loops still run as their own processes): a `pitstop`
    # process per command loaded torch and transformers again, about 12 s each on a busy
    # 2-core machine. The torchrun test below keeps `python -m pitstop` end to end.
    from pitstop import cli

    monkeypatch.chdir(tmp_path)  # the runs' relative names and recorded cwd, as from a shell
    for name, sleep in (("a", "0.05"), ("b", "0")):
        cmd = [sys.executable, str(LOOP), "--steps", "5", "--sleep", sleep]
        assert cli.main(["profile", "--output", name, "--", *cmd]) == 0, capsys.readouterr().err
    capsys.readouterr()
    rc = cli.main(["compare", "a", "b", "--rerun", "1", "--rerun-output", "re"])
    out, err = capsys.readouterr()
    assert rc == 0, err[-2000:]
    assert "pair 1:" in out and (tmp_path / "re" / "1-b" / "summary.json").is_file()


@pytest.mark.slow
@pytest.mark.long
def test_torchrun_launcher_form_rank0_writes(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside this python")
    cmd = [str(torchrun), "--nproc-per-node", "2", str(LOOP), "--steps", "4", "--sleep", "0.05"]
    res = pitstop_cli("profile", "--output", "tr", "--", *cmd, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "tr" / "summary.json").read_text())
    assert summary["optimizer_steps"] == 4  # rank 0's steps, written once
    assert "verdict:" in res.stdout
