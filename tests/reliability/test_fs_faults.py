"""File-system faults outside the checkpoint writer: one clear error, never a traceback.

A full disk under prepare's store append, a read-only --cache-dir on a cache miss
(prepare and train), a run directory deleted mid-run. The real faults are made with a
private mount namespace (`unshare -m`: a tiny tmpfs, a read-only bind mount) where the
machine allows it; the handler's rules (path, errno, what is safe, the first failure
first) are also checked directly.
"""

from __future__ import annotations

import errno
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _rel import env, held, hold_at, no_traceback, release, start, train_cmd, wait_until

from pitstop.core.errors import DataError
from pitstop.fs_errors import FileSystemError, file_errors


def _namespace_ok(tmp: Path) -> str | None:
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    d = tmp / "probe"
    d.mkdir()
    r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {d}"],
                       capture_output=True, text=True)  # fmt: skip
    return None if r.returncode == 0 else f"cannot mount here: {r.stderr.strip()}"


def _in_namespace(setup: str, cmd: list[str]) -> subprocess.CompletedProcess:
    script = f"{setup} && exec {shlex.join(cmd)}"
    return subprocess.run(["unshare", "-m", "sh", "-c", script], env=env(), capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def _dataset(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"text": f"record {i} " + "word " * 60}) + "\n"
                            for i in range(n)))  # fmt: skip
    return path


def _prepare(model: Path, data: Path, cache: Path) -> list[str]:
    return [sys.executable, "-m", "pitstop", "prepare", "--model", str(model), "--data",
            str(data), "--cache-dir", str(cache), "--workers", "1"]  # fmt: skip


@pytest.mark.slow
def test_full_disk_during_store_append(tiny_model_dir, tmp_path):
    why = _namespace_ok(tmp_path)
    if why:
        pytest.skip(why)
    cache = tmp_path / "cache"
    cache.mkdir()
    data = _dataset(tmp_path / "d.jsonl", 3000)  # ~190k tokens: ~570 KB of arrays
    r = _in_namespace(
        f"mount -t tmpfs -o size=256k tmpfs {cache}", _prepare(tiny_model_dir, data, cache)
    )
    assert r.returncode == 1, r.stderr[-3000:]
    no_traceback(r.stderr)
    err = " ".join(r.stderr.split())
    assert "no space left on the device (ENOSPC" in err and str(cache) in err, err
    assert "Nothing was added to the cache" in err and "free space" in err


@pytest.mark.slow
@pytest.mark.parametrize("command", ["prepare", "train"])
def test_read_only_cache_dir_on_a_cache_miss(command, tiny_model_dir, tmp_path):
    why = _namespace_ok(tmp_path)
    if why:
        pytest.skip(why)
    cache = tmp_path / "cache"
    cache.mkdir()
    data = _dataset(tmp_path / "d.jsonl", 40)
    if command == "prepare":
        cmd = _prepare(tiny_model_dir, data, cache)
    else:
        cmd = train_cmd(tiny_model_dir, data, tmp_path / "out", steps=2)
        cmd[cmd.index("--cache-dir") + 1] = str(cache)
    r = _in_namespace(f"mount --bind {cache} {cache} && mount -o remount,bind,ro {cache}", cmd)
    assert r.returncode == 1, r.stderr[-3000:]
    no_traceback(r.stderr)
    err = " ".join(r.stderr.split())
    assert "the file system is read-only (EROFS" in err and str(cache) in err, err
    assert "give a writable location" in err
    assert not list(cache.rglob("*")), "nothing may be left in a cache that could not be written"


@pytest.mark.slow
def test_run_directory_deleted_mid_run(tiny_model_dir, rel_store, tmp_path):
    """The run directory vanishes while a checkpoint is being written: one clear error,
    and no claim that a checkpoint is intact (there is none left)."""
    out = tmp_path / "out"
    gate = tmp_path / "gate"
    proc = start(train_cmd(tiny_model_dir, rel_store, out), **hold_at("ckpt-write:4", gate))
    assert wait_until(lambda: held(gate), proc, "the step-4 write")
    gone = tmp_path / "gone"
    out.rename(gone)  # atomic: the path is gone at once, whatever the run is writing
    shutil.rmtree(gone, ignore_errors=True)
    release(gate)
    proc.wait(300)
    stderr = proc.stderr.read() if proc.stderr else ""
    assert proc.returncode == 1, stderr[-3000:]
    no_traceback(stderr)
    err = " ".join(stderr.split())
    assert "is intact" not in err, err
    assert "ENOENT" in err and "nothing of this run survives" in err, err


@pytest.mark.parametrize("under", [False, True])
def test_a_cache_dir_that_is_a_file(tiny_model_dir, tmp_path, under):
    """`--cache-dir FILE` (or FILE/sub): one error naming the file, the file untouched."""
    afile = tmp_path / "afile.txt"
    afile.write_text("mine")
    data = _dataset(tmp_path / "d.jsonl", 4)
    cache = afile / "sub" if under else afile
    r = subprocess.run(_prepare(tiny_model_dir, data, cache), env=env(), capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 1, r.stderr[-3000:]
    no_traceback(r.stderr)
    err = " ".join(r.stderr.split())
    what = "a part of the path is a file, not a directory (ENOTDIR" if under else "(EEXIST"
    assert f"{cache}: " in err and what in err, err
    assert "Nothing was added to the cache" in err and afile.read_text() == "mine"


def test_handler_names_path_errno_and_what_is_safe(tmp_path):
    with pytest.raises(FileSystemError) as e, file_errors(tmp_path, lambda: "Nothing was lost"):
        raise OSError(errno.ENOSPC, "No space left on device")  # write() gives no path
    msg = e.value.render()
    assert f"while writing under {tmp_path}" in msg and "ENOSPC" in msg
    assert msg.endswith("Nothing was lost")
    with pytest.raises(FileSystemError) as e, file_errors(None):
        raise PermissionError(errno.EACCES, "Permission denied", "/x/y")
    assert e.value.render().startswith("/x/y: permission denied (EACCES")


def test_a_second_failure_while_stopping_does_not_mask_the_first(tmp_path):
    with pytest.raises(FileSystemError) as e, file_errors(tmp_path):
        try:
            raise OSError(errno.EROFS, "Read-only file system", "/run/metrics.jsonl")
        finally:  # shutting down writes a summary into the same place, and fails too
            raise OSError(errno.ENOENT, "No such file or directory", "/run/summary.json")
    msg = e.value.render()
    assert msg.startswith("/run/metrics.jsonl: the file system is read-only"), msg
    assert "then, while stopping: [Errno 2]" in msg and "/run/summary.json" in msg
    first = DataError("the store is damaged")
    with pytest.raises(FileSystemError) as e, file_errors(tmp_path):
        try:
            raise first
        finally:
            raise OSError(errno.ENOSPC, "No space left on device")
    assert e.value.render().startswith("the store is damaged") and e.value.exit_code == 1


def test_other_errors_pass_through_unchanged(tmp_path):
    with pytest.raises(DataError, match="plain"), file_errors(tmp_path):
        raise DataError("plain")
    with pytest.raises(OSError, match="Input/output"), file_errors(tmp_path):
        raise OSError(errno.EIO, "Input/output error")  # not a fault the user can fix by path


def test_report_into_a_read_only_place(tmp_path, monkeypatch, capsys):
    """`pitstop report` whose output cannot be written: the path and the errno, no traceback."""
    from pitstop.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"optimizer_steps": 1}))
    out = tmp_path / "r" / "report.html"

    def read_only(self: Path, *a: object, **k: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "write_text", read_only)
    rc = main(["report", str(run), "--output", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and "the file system is read-only (EROFS" in err and str(out.parent) in err
    assert "An existing report was not touched" in err and "Traceback" not in err
