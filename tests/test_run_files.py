"""pitstop's own files in an OUT_DIR without a run, told from a user's by their content
(pitstop/core/run_files.py), and the --config file a run must never lose."""

from __future__ import annotations

import json
from pathlib import Path

from pitstop.core import run_files, run_record
from pitstop.core.config import RunConfig
from pitstop.probe import config_file_problem, output_dir_problem

STEP = {"step": 1, "epoch": 0.1, "lr": 1e-3, "loss": 2.5, "grad_norm": 1.0, "skipped": False,
        "step_seconds": 0.1, "trained_tokens": 10}  # fmt: skip


def _cfg(out: Path, **kw) -> RunConfig:
    return RunConfig(model="m", data=["d"], output=str(out), **kw)


def test_pitstops_own_files_are_recognised(tmp_path):
    (tmp_path / "config.yaml").write_text(_cfg(tmp_path, resume=True, lr=3e-4).saved_yaml())
    lines = [json.dumps({**STEP, "step": s}) for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 3, "lo')  # cut off
    (tmp_path / "wandb-run-id").write_text("a1b2c3d4\n")
    (tmp_path / ".lock").write_text("1234 host\n")
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"\0")
    (tmp_path / "report.html").write_text("")  # empty: nothing to lose
    assert run_files.foreign_files(tmp_path) == []
    assert output_dir_problem(str(tmp_path), resume=False, overwrite=False) is None


def test_a_users_files_at_the_runs_names_are_foreign(tmp_path):
    (tmp_path / "config.yaml").write_text("# mine\nlr: 0.001\n")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    (tmp_path / "choices.json").write_text('{"my": "notes"}')
    (tmp_path / "wandb-run-id").write_text("not an id\n")
    (tmp_path / ".lock").write_text("my lock notes\n")
    (tmp_path / "report.html").write_text("<html></html>")
    (tmp_path / "merged").mkdir()
    (tmp_path / "merged" / "model.bin").write_text("x")
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "notes.txt").write_text("x")
    foreign = run_files.foreign_files(tmp_path)
    assert sorted(foreign) == sorted(run_files.TRAIN_WRITES)
    for resume in (False, True):  # --resume has no run there to continue
        p = output_dir_problem(str(tmp_path), resume=resume, overwrite=False)
        assert p is not None and "is not a pitstop run but holds config.yaml" in p
    assert output_dir_problem(str(tmp_path), resume=False, overwrite=True) is None


def test_a_pitstop_config_with_comments_or_a_start_flag_is_not_pitstops(tmp_path):
    text = _cfg(tmp_path).saved_yaml()
    p = tmp_path / "config.yaml"
    p.write_text("# edited\n" + text)
    assert not run_files.own_config(p)
    p.write_text(text.replace("resume: false", "resume: true"))
    assert not run_files.own_config(p)


def test_the_config_file_is_never_removed_or_rewritten(tmp_path):
    conf = tmp_path / "config.yaml"
    cfg = _cfg(tmp_path, lr=3e-4)
    conf.write_text(cfg.saved_yaml())
    assert config_file_problem(str(conf), cfg) is None  # the run writes the same bytes
    assert "--overwrite removes" in (
        config_file_problem(str(conf), _cfg(tmp_path, overwrite=True)) or ""
    )
    changed = _cfg(tmp_path, lr=1e-3)
    assert "the run replaces" in (config_file_problem(str(conf), changed) or "")
    # --resume keeps a differing one beside it (train/run_dir.py): allowed
    assert config_file_problem(str(conf), _cfg(tmp_path, lr=1e-3, resume=True)) is None
    metrics = tmp_path / run_record.METRICS
    metrics.write_text("lr: 0.001\n")
    assert "which the run writes" in (config_file_problem(str(metrics), cfg) or "")
    assert config_file_problem(str(tmp_path / "elsewhere.yaml"), cfg) is None
