"""`pitstop export --merge` against what a user may give it, and signals while it writes.

A run that is not LoRA, a run still training, a partial run directory, an existing or a
read-only output: each is refused before anything loads, in one paragraph with the fix,
or exported correctly. SIGINT/SIGTERM while the merged copy is written stop the export
with nothing left behind; after a SIGKILL the rerun works and removes the debris.
Signals land at the `export-write` fault point (pitstop/core/faults.py), never at a guess.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _rel import (
    KILLED,
    die_at,
    env,
    held,
    hold_at,
    no_traceback,
    release,
    run,
    sigkill,
    start,
    train_cmd,
    wait_until,
)

pytest.importorskip("peft")
pytestmark = pytest.mark.slow


def export_cmd(src: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pitstop", "export", str(src), "--merge", *extra]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir, rel_store) -> Path:
    out = tmp_path_factory.mktemp("lora") / "out"
    done = run(train_cmd(tiny_model_dir, rel_store, out, "--lora-r", "4", steps=2))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "final" / "adapter_config.json").is_file()
    return out


def _copy_run(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("merged", ".lock"))
    return dest


def _debris(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if ".partial-" in p.name or ".old-" in p.name)


def _one_paragraph(err: str) -> str:
    no_traceback(err)
    lines = [ln for ln in err.splitlines() if ln.startswith("pitstop export: ")]
    assert len(lines) == 1, err[-2000:]
    return lines[0]


def test_a_full_fine_tune_is_refused(reference, capsys):
    from pitstop.cli import main

    assert main(["export", str(reference), "--merge"]) == 2
    msg = _one_paragraph(capsys.readouterr().err)
    assert "holds a full fine-tuned model, not a LoRA adapter" in msg
    assert not (reference / "merged").exists()


def test_an_unfinished_full_fine_tune_and_its_checkpoint_are_refused(reference, tmp_path, capsys):
    """Before: the run's refusal suggested exporting its checkpoint, which was then refused
    as "its final/ already is a plain model" (it has none). Now both say what they hold."""
    from pitstop.cli import main

    part = _copy_run(reference, tmp_path / "part")
    shutil.rmtree(part / "final")
    assert main(["export", str(part), "--merge"]) == 2
    msg = _one_paragraph(capsys.readouterr().err)
    assert "a full fine-tuned model, not a LoRA adapter: there is nothing to merge" in msg, msg
    assert "has no final/ yet" in msg and "--resume" in msg and "step-" not in msg, msg
    ckpt = sorted((part / "checkpoints").glob("step-*"))[-1]
    assert main(["export", str(ckpt), "--merge"]) == 2
    msg = _one_paragraph(capsys.readouterr().err)
    assert "holds a full model's weights (config.json, no adapter_config.json)" in msg, msg
    assert "final/" not in msg and not _debris(part)


def test_a_missing_run_is_named(tmp_path, capsys):
    from pitstop.cli import main

    assert main(["export", str(tmp_path / "nope"), "--merge"]) == 2
    assert "does not exist" in _one_paragraph(capsys.readouterr().err)


def test_a_run_still_training_is_refused(tiny_model_dir, rel_store, tmp_path, capsys):
    from pitstop.cli import main

    out, gate = tmp_path / "out", tmp_path / "gate"
    first = start(train_cmd(tiny_model_dir, rel_store, out, "--lora-r", "4", steps=4),
                  **hold_at("ckpt-write:2", gate))  # fmt: skip
    try:
        assert wait_until(lambda: held(gate), first, "the step-2 write")
        capsys.readouterr()
        assert main(["export", str(out), "--merge"]) == 2
        msg = _one_paragraph(capsys.readouterr().err)
        assert f"is still training (pid {first.pid}" in msg and "step-N --merge" in msg, msg
        assert not (out / "merged").exists() and not _debris(out)
        release(gate)
        _, err = first.communicate(timeout=240)
        assert first.returncode == 0, err[-3000:]  # the export did not disturb the run
    finally:
        sigkill(first)


def test_a_partial_run_names_its_checkpoint_and_that_export_works(lora_run, tmp_path, capsys):
    from pitstop.cli import main

    part = _copy_run(lora_run, tmp_path / "part")
    shutil.rmtree(part / "final")
    (part / "summary.json").unlink()
    assert main(["export", str(part), "--merge"]) == 2
    msg = _one_paragraph(capsys.readouterr().err)
    ckpt = part / "checkpoints" / "step-2"
    suggested = f"pitstop export {ckpt} --merge --output {part / 'merged'}"
    assert "has no final/" in msg and suggested in msg and "--resume" in msg, msg
    done = run(shlex.split(suggested.replace("pitstop", f"{sys.executable} -m pitstop", 1)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (part / "merged" / "model.safetensors").is_file()


def test_an_existing_output_is_never_replaced(lora_run, tmp_path, capsys):
    from pitstop.cli import main

    mine = tmp_path / "my-model"
    mine.mkdir()
    (mine / "config.json").write_text("{}")  # someone's model, not an export
    assert main(["export", str(lora_run), "--merge", "--output", str(mine)]) == 2
    msg = _one_paragraph(capsys.readouterr().err)
    assert f"--output {mine} exists and is not empty" in msg
    assert sorted(p.name for p in mine.iterdir()) == ["config.json"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(lora_run), "--merge", "--output", str(empty)]) == 0
    assert (empty / "model.safetensors").is_file() and not _debris(tmp_path)


def test_a_read_only_output_is_refused_before_loading(lora_run, tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    ro = tmp_path / "ro"
    ro.mkdir()
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind {ro} {ro}"],
                           capture_output=True, text=True)  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {probe.stderr.strip()}")
    cmd = shlex.join(export_cmd(lora_run, "--output", str(ro / "m")))
    script = f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro} && exec {cmd}"
    r = subprocess.run(["unshare", "-m", "sh", "-c", script], env=env(), capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 1, r.stderr[-3000:]
    msg = " ".join(_one_paragraph(r.stderr).split())
    assert "read-only" in msg and "give a writable location" in msg, msg
    assert not any(ro.iterdir())


@pytest.mark.parametrize(
    "sig",
    # SIGTERM takes the same handler as SIGINT: `make soak` only, to keep the suite short.
    [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.soak)],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_signal_while_writing_leaves_nothing_and_the_rerun_works(sig, lora_run, tmp_path):
    src = _copy_run(lora_run, tmp_path / "run")
    gate = tmp_path / "gate"
    proc = start(export_cmd(src), **hold_at("export-write", gate))
    try:
        assert wait_until(lambda: held(gate), proc, "the merged copy's write")
        assert _debris(src), "the partial copy exists while it is written"
        proc.send_signal(sig)
        release(gate)
        _, err = proc.communicate(timeout=120)
    finally:
        sigkill(proc)
    assert proc.returncode == 128 + sig, err[-3000:]
    msg = _one_paragraph(err)
    assert f"{sig.name} stopped the export: nothing was written" in msg, msg
    assert not (src / "merged").exists() and not _debris(src)
    again = run(export_cmd(src))
    assert again.returncode == 0, again.stderr[-3000:]
    assert (src / "merged" / "model.safetensors").is_file()


def test_sigkill_while_writing_then_the_rerun_works_and_clears_the_debris(lora_run, tmp_path):
    src = _copy_run(lora_run, tmp_path / "run")
    killed = run(export_cmd(src), **die_at("export-write"))
    assert killed.returncode == KILLED, killed.stderr[-3000:]
    assert not (src / "merged").exists(), "nothing half-written may look complete"
    left = _debris(src)
    assert left and all(n.startswith(".merged.partial-") for n in left), left
    again = run(export_cmd(src))  # no stale lock refuses it
    assert again.returncode == 0, again.stderr[-3000:]
    assert (src / "merged" / "model.safetensors").is_file()
    assert not _debris(src), "the killed export's partial copy was not removed"
    assert not [p for p in os.listdir(src) if p.startswith(".final.partial")]
