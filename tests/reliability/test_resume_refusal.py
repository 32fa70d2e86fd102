"""--resume continues exactly the same run, or refuses and touches nothing.

* checkpoints present but none complete: refused, each one's fault listed, the run
  directory unchanged (it used to restart from step 0 over intact weights);
* a damaged newest checkpoint: the fallback names it and why, and the result is exact;
* a setting that changes the math (lr, max steps, data content, model): refused with
  the list unless --resume-with-changes, which keeps both configurations.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from _rel import assert_same_as, metric_lines, no_traceback, run, train_cmd

pytestmark = pytest.mark.slow


def _tree(d: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_dir, rel_store) -> Path:
    """A completed BASE_STEPS run; its checkpoints are step-6 and step-8."""
    out = tmp_path_factory.mktemp("finished") / "out"
    done = run(train_cmd(tiny_model_dir, rel_store, out))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _copy(run_dir: Path, dest: Path) -> Path:
    shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns(".lock"))
    return dest


def test_no_complete_checkpoint_is_refused_and_nothing_changes(
    finished, tiny_model_dir, rel_store, tmp_path
):
    out = _copy(finished, tmp_path / "out")
    shutil.rmtree(out / "final")  # as if killed before its end
    for step in (6, 8):
        (out / "checkpoints" / f"step-{step}" / "optimizer.pt").unlink()
    before = _tree(out)
    r = run([*train_cmd(tiny_model_dir, rel_store, out), "--resume"])
    assert r.returncode == 1, r.stderr[-3000:]
    no_traceback(r.stderr)
    err = " ".join(r.stderr.split())
    assert "no checkpoint in it is complete, so nothing was changed" in err, err[-2000:]
    for step in (6, 8):
        assert f"{out / 'checkpoints' / f'step-{step}'} is damaged: optimizer.pt is missing" in err
    assert _tree(out) == before


def test_damaged_newest_falls_back_naming_it_and_stays_exact(
    finished, reference, tiny_model_dir, rel_store, tmp_path
):
    out = _copy(finished, tmp_path / "out")
    shutil.rmtree(out / "final")
    (out / "checkpoints" / "step-8" / "rng.json").write_text("{}")  # another size
    r = run([*train_cmd(tiny_model_dir, rel_store, out), "--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    err = " ".join(r.stderr.split())
    assert f"resuming from the older checkpoint {out / 'checkpoints' / 'step-6'}" in err
    assert f"{out / 'checkpoints' / 'step-8'} is damaged: rng.json has 2 bytes" in err
    assert_same_as(out, reference)


@pytest.mark.parametrize(
    "extra, needle",
    [(["--lr", "0.01"], "lr: 0.001 then, 0.01 now"),
     (["--max-steps", "30"], "max_steps: 8 then, 30 now")],
    ids=["lr", "max-steps"],
)  # fmt: skip
def test_changed_math_is_refused_with_the_list(
    extra, needle, finished, tiny_model_dir, rel_store, tmp_path
):
    out = _copy(finished, tmp_path / "out")
    before = _tree(out)
    r = run([*train_cmd(tiny_model_dir, rel_store, out), "--resume", *extra])
    assert r.returncode == 2, r.stderr[-3000:]
    no_traceback(r.stderr)
    assert needle in r.stderr and "--resume-with-changes" in r.stderr, r.stderr[-2000:]
    assert _tree(out) == before  # config.yaml included


def test_resume_with_changes_keeps_both_configurations(
    finished, tiny_model_dir, rel_store, tmp_path
):
    out = _copy(finished, tmp_path / "out")
    cmd = train_cmd(tiny_model_dir, rel_store, out, steps=10)
    r = run([*cmd, "--resume", "--resume-with-changes"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "max_steps: 8 then, 10 now" in r.stderr
    old = yaml.safe_load((out / "config.before-step-8.yaml").read_text())
    new = yaml.safe_load((out / "config.yaml").read_text())
    assert (old["max_steps"], new["max_steps"]) == (8, 10)
    assert [x["step"] for x in metric_lines(out)] == list(range(1, 11))


def test_same_documents_in_another_order_is_another_run(tiny_model_dir, tmp_path):
    """The data identity is the store's content key: same counts, other order, refused."""
    from pitstop.core.corpus import sample_texts

    docs = [json.dumps({"text": t}) for t in sample_texts(40)]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(docs) + "\n")
    out = tmp_path / "out"
    cmd = train_cmd(tiny_model_dir, data, out, steps=4)
    first = run(cmd)
    assert first.returncode == 0, first.stderr[-3000:]
    data.write_text("\n".join(reversed(docs)) + "\n")  # same size, same counts
    os.utime(data)
    r = run([*cmd, "--resume"])
    assert r.returncode == 2, r.stderr[-3000:]
    no_traceback(r.stderr)
    assert "data: '" in r.stderr and "then, '" in r.stderr, r.stderr[-2000:]
