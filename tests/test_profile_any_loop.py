"""`pitstop profile -- python loop.py` and `pitstop.watch` on a plain PyTorch loop (CPU).

The loop (examples/custom_loop.py) is shaped like the hand-written loops of issue 24:
tokenization in `__getitem__`, batch 1, `num_workers=0`. With a slow loader it must be
called input-bound with its data-wait share; the same loop with the loader fixed must
compare faster; `pitstop report` must render both.
"""

from __future__ import annotations

import io
import json
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

import pitstop
from pitstop.measure.timeline import PHASES
from pitstop.report.compare import compare

ROOT = Path(__file__).resolve().parents[1]
LOOP = ROOT / "examples" / "custom_loop.py"
SLEEP_S = 0.5  # long enough to dominate a step even on a loaded 2-core machine
STEPS = 8


@pytest.fixture(scope="module")
def loops(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Both loops profiled through the CLI in this process (each loop runs as its own
    process): a `pitstop` process per profile loaded torch and transformers again, about
    12 s each on a busy 2-core machine (test_compare_rerun's torchrun test runs
    `python -m pitstop profile -- ...` as a process)."""
    from pitstop import cli

    d = tmp_path_factory.mktemp("anyloop")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(d)
        for name, sleep in (("slow", SLEEP_S), ("fixed", 0.0)):
            cmd = [sys.executable, str(LOOP), str(tiny_model_dir), "--steps", str(STEPS)]
            cmd += ["--sleep", str(sleep)]
            stdout, stderr = io.StringIO(), io.StringIO()
            with redirect_stdout(stdout), redirect_stderr(stderr):
                rc = cli.main(["profile", "--output", str(d / name), "--", *cmd])
            assert rc == 0, stderr.getvalue()[-3000:]
            out[name] = (d / name, stdout.getvalue())
    out["dir"] = d
    return out


@pytest.mark.slow
def test_slow_loader_is_input_bound(loops: dict) -> None:
    run, stdout = loops["slow"]
    assert "verdict: input-bound" in stdout
    prof = json.loads((run / "pitstop_profile.json").read_text())
    share = prof["phases"]["data_wait"] / sum(prof["step_seconds"])
    assert share >= 0.2 and f"{100 * share:.1f}%" in stdout  # severe: 20% or more
    summary = json.loads((run / "summary.json").read_text())
    assert summary["source"] == "script" and summary["optimizer_steps"] == STEPS
    assert summary["config"]["dataloader_num_workers"] == 0
    assert summary["config"]["per_device_train_batch_size"] == 1
    findings = json.loads((run / "findings.json").read_text())["findings"]
    assert any(f["id"] == "input-bound" for f in findings)
    # metrics.jsonl: one line per optimizer step, the warm-up step marked, phases add up
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["warmup"] for x in lines] == [True] + [False] * (STEPS - 1)
    for x in lines:
        assert sum(x[f"{p}_s"] for p in PHASES) == pytest.approx(x["step_seconds"], rel=1e-6)
        assert x["step_rows"] == 1 and x["step_trained_tokens"] > 0


@pytest.mark.slow
def test_doctor_and_estimate_read_the_profiled_run(
    loops: dict, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pitstop import cli

    run, _ = loops["slow"]
    assert cli.main(["doctor", "--profile", str(run / "pitstop_profile.json")]) == 0
    assert "input-bound" in capsys.readouterr().out
    argv = ["estimate", "--from-profile", str(run), "--model", str(tiny_model_dir)]
    assert cli.main([*argv, "--tokens", "100000"]) == 0
    assert "measured" in capsys.readouterr().out


@pytest.mark.slow
def test_fixed_loader_compares_faster_and_report_renders_both(
    loops: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    from pitstop import cli

    (slow, _), (fixed, _) = loops["slow"], loops["fixed"]

    # Fixing the loader cuts the data-wait share to well under half the slow loop's (~95%:
    # a 0.5 s sleep per step). Not an absolute share: a loaded machine stretches the fixed
    # loop's few milliseconds of host work into 19.8% and 20.4% of its ~20 ms step (seen
    # in full-suite runs), around the 20% line of a "severe" verdict.
    def wait_share(run: Path) -> float:
        prof = json.loads((run / "pitstop_profile.json").read_text())
        return prof["phases"]["data_wait"] / sum(prof["step_seconds"])

    assert wait_share(fixed) < 0.5 * wait_share(slow), (wait_share(fixed), wait_share(slow))
    res = compare(slow, fixed)
    rows = {r["metric"]: r for r in res["metrics"]}
    assert rows["data_wait_share"]["verdict"] == "better"
    tps = rows["tokens_per_second"]
    diffs = {d["setting"]: (d["a"], d["b"]) for d in res["settings_differ"]}
    assert f"--sleep {SLEEP_S}" in diffs["command"][0] and "--sleep 0.0" in diffs["command"][1]
    # Faster beyond the noise band. Unless another job loaded the machine during one of the
    # runs (the 2-core dev box shared by several test runs, where a tiny model's step has
    # been seen to take 5x longer for a whole run): the table then flags it NOISY, and a
    # timing verdict is not a property of the code (docs/compare.md: settle with --rerun).
    if not (res["steady"]["a"]["noisy"] or res["steady"]["b"]["noisy"]):
        assert tps["ratio"] > 1 and tps["verdict"] == "better", res["noise_band"]
    assert cli.main(["compare", str(slow), str(fixed)]) == 0
    assert "better" in capsys.readouterr().out
    html = loops["dir"] / "report.html"
    assert cli.main(["report", str(slow), str(fixed), "--output", str(html)]) == 0
    text = html.read_text()
    assert "slow" in text and "fixed" in text
    assert "tokens/s (steady, all ranks)" in text and "noise (block spread)" in text


def test_watch_in_process_counts_tokens_and_ignores_eval(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.randint(5, 100, (8, 12))
    labels = ids.clone()
    labels[:, :4] = -100  # a prompt: 4 masked positions per row
    rows = [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels)]
    loader = DataLoader(rows, batch_size=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pitstop.watch(output=tmp_path / "run", warmup_steps=1, print_report=False) as w:
        for batch in loader:
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():  # an evaluation pass: eval time, not trained tokens
            for batch in loader:
                model(**batch)
    s = w.summary
    assert s is not None and s.optimizer_steps == 4
    # labels shifted by one inside the model: row targets = 12 - 4 (masked) = 8 of 11 shifted
    assert s.trained_tokens == 8 * 8
    assert s.seen_tokens == 8 * 12
    assert s.time_breakdown["eval"] > 0 and s.time_breakdown["forward"] > 0
    assert s.final_loss is not None
    assert (tmp_path / "run" / "summary.json").is_file()
    with pytest.raises(pitstop.ConfigError, match="warmup_steps"):
        pitstop.watch(warmup_steps=-1)


def test_watch_accumulates_micro_batches_into_one_step(tiny_model_dir: Path) -> None:
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    data = [(torch.randint(5, 100, (10,)), torch.randint(5, 100, (10,))) for _ in range(8)]
    loader = DataLoader(data, batch_size=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = pitstop.watch(print_report=False, doctor=False).start()
    for i, (x, y) in enumerate(loader, 1):
        model(input_ids=x, labels=y).loss.backward()
        if i % 4 == 0:  # gradient accumulation over 4 micro-batches
            opt.step()
            opt.zero_grad()
    s = w.stop()
    assert s is not None and s.optimizer_steps == 2 and s.rows == 8
    assert s.config["gradient_accumulation_steps"] == 4
    assert s.trained_tokens == 8 * 9  # tuple batches: the second int tensor is the labels


def test_profile_command_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pitstop import cli

    assert cli.main(["profile", "--lr", "0.1", "--", sys.executable, "x.py"]) == 2
    assert cli.main(["profile", "--"]) == 2
    # Without `--`, leftover words are the config form's: a misspelt flag is still named.
    assert cli.main(["profile", "--modle", "x"]) == 2
    assert "did you mean --model?" in capsys.readouterr().err
    assert cli.main(["profile", "--", "no-such-program-pitstop"]) == 2
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "summary.json").write_text("{}")
    assert cli.main(["profile", "--output", str(tmp_path / "done"), "--", sys.executable]) == 2
    (tmp_path / "file").write_text("")
    assert cli.main(["profile", "--output", str(tmp_path / "file"), "--", sys.executable]) == 2
