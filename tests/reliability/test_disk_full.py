"""A checkpoint write that fails (disk full) stops the run cleanly; --resume carries on.

Two failures: the PITSTOP_TEST_CKPT_FAIL hook (ENOSPC raised inside the writer) and,
where the test may mount one, a real tmpfs too small for a second checkpoint. Either
way the previous checkpoint stays valid, the partial directory is removed, the error
names the cause, the intact checkpoint and --resume, and resuming matches a run that
never failed.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from _rel import (
    assert_same_as,
    check_accepted_checkpoints,
    env,
    no_traceback,
    run,
    train_cmd,
)

pytestmark = pytest.mark.slow


def _assert_clean_stop(out: Path, stderr: str, returncode: int) -> str:
    assert returncode == 1, stderr[-3000:]
    no_traceback(stderr)
    err = " ".join(stderr.split())
    assert "writing a checkpoint under" in err and "failed" in err, err[-1500:]
    assert f"previous complete checkpoint ({out / 'checkpoints' / 'step-2'}) is intact" in err
    assert "--resume" in err
    assert check_accepted_checkpoints(out) == [2]
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    assert json.loads((out / "summary.json").read_text())["status"] == "failed"
    return err


def test_injected_write_failure_stops_cleanly_and_resume_continues(
    tiny_model_dir, rel_store, reference, tmp_path
):
    out = tmp_path / "out"
    cmd = train_cmd(tiny_model_dir, rel_store, out)
    bad = run(cmd, PITSTOP_TEST_CKPT_FAIL="4")
    assert "No space left on device" in _assert_clean_stop(out, bad.stderr, bad.returncode)
    done = run([*cmd, "--resume"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_as(out, reference)


def _can_mount_tmpfs(tmp: Path) -> str | None:
    """None when `unshare -m` + `mount -t tmpfs` work here, else the reason."""
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    probe = tmp / "probe"
    probe.mkdir()
    flags = (
        "-m" if hasattr(__import__("os"), "geteuid") and __import__("os").geteuid() == 0 else "-rm"
    )
    r = subprocess.run(["unshare", flags, "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {probe}"],
                       capture_output=True, text=True)  # fmt: skip
    return None if r.returncode == 0 else f"cannot mount a tmpfs here: {r.stderr.strip()}"


def test_real_full_tmpfs_keeps_the_previous_checkpoint(
    tiny_model_dir, rel_store, reference, tmp_path
):

    why = _can_mount_tmpfs(tmp_path)
    if why:
        pytest.skip(why)
    # Room for the run's small files and one checkpoint, not for a second one (the
    # kept-2 policy means step-4 must coexist with step-2): the write of step 4 fails.
    one = sum(p.stat().st_size for p in (reference / "checkpoints" / "step-8").rglob("*"))
    size_kb = int(one * 1.5) // 1024
    disk = tmp_path / "disk"
    disk.mkdir()
    out, saved = disk / "out", tmp_path / "saved"
    cmd = train_cmd(tiny_model_dir, rel_store, out)
    cmd[cmd.index("--cache-dir") + 1] = str(tmp_path / "cache")  # the cache stays off the tmpfs
    # The mount lives in a private mount namespace: it disappears with the shell, so the
    # run's directory is copied out (cp -a) for the checks after the run.
    script = (
        f"mount -t tmpfs -o size={size_kb}k tmpfs {disk} && "
        f"{{ {' '.join(map(shlex.quote, cmd))} 2> {tmp_path / 'err.txt'}; echo $? > {tmp_path / 'rc.txt'}; }}; "
        f"cp -a {out} {saved}"
    )
    flags = "-m" if os.geteuid() == 0 else "-rm"
    r = subprocess.run(["unshare", flags, "sh", "-c", script], env=env(), capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    stderr = (tmp_path / "err.txt").read_text()
    rc = int((tmp_path / "rc.txt").read_text())
    err = _assert_clean_stop(saved, stderr.replace(str(out), str(saved)), rc)
    assert not any(disk.iterdir()), "the tmpfs was mounted outside the private namespace"
    # torch.save on a full disk fails with "[enforce fail at inline_container.cc] unexpected
    # pos ..."; the writer adds the free space and names the full disk.
    assert "No space left" in err or "is full" in err, err[-1500:]
