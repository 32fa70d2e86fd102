"""A FIFO (or a directory) where a cache file or the run lock should be, and a stale lock.

A plain `open` of a FIFO waits for a writer that never comes: the earlier hostile trial
hung there for good. Every such read now opens without blocking and refuses anything but
a regular file, naming the path, what it is and how to fix it. Each hang-prone call runs
in a child process under a timeout, so a regression fails the test instead of hanging it.

A stale lock whose recorded pid now belongs to another live process must not refuse a
run: the lock is an flock, held by the kernel for a live holder only, and the pid in
the file is only a name for the message.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _rel import env, no_traceback

from pitstop.core import runlock
from pitstop.core.atomic import NotARegularFile

HANG = 60  # seconds: far above the instant a refusal takes


def _child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env(),
                          capture_output=True, text=True, timeout=HANG)  # fmt: skip


def test_fifo_at_a_fingerprint_memo_is_refused_not_waited_on(tmp_path):
    from pitstop.core.cache_layout import FINGERPRINTS
    from pitstop.data.cache import file_fingerprint

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n')
    root = tmp_path / "cache"
    file_fingerprint(data, root)  # writes the memo; then a FIFO takes its place
    (memo,) = (root / FINGERPRINTS).iterdir()
    memo.unlink()
    os.mkfifo(memo)
    r = _child(f"""
        from pitstop.data.cache import file_fingerprint
        from pitstop.core.errors import PitstopError
        try:
            file_fingerprint({str(data)!r}, __import__("pathlib").Path({str(root)!r}))
        except PitstopError as e:
            print(e)
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{memo} is a named pipe (FIFO)" in r.stdout and f"rm {memo}" in r.stdout, r.stdout


def test_fifo_given_as_a_file_to_hash_is_refused(tmp_path):
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    r = _child(f"""
        from pathlib import Path
        from pitstop.data.cache import _digest_file
        from pitstop.core.errors import PitstopError
        try:
            _digest_file(Path({str(fifo)!r}))
        except PitstopError as e:
            print(e)
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "named pipe (FIFO)" in r.stdout and "regular file" in r.stdout, r.stdout


def test_fifo_at_a_trial_cache_entry_is_refused(tmp_path):
    r = _child(f"""
        import os
        from pitstop.core.errors import PitstopError
        from pitstop.tune.space import Settings
        from pitstop.tune.trial import TrialCache
        cache = TrialCache({str(tmp_path)!r}, {{"any": "context"}})
        s = Settings("pack", 1, 0, 2, False, "sdpa")
        cache.dir.mkdir(parents=True)
        os.mkfifo(cache.dir / (cache.key(s) + ".json"))
        try:
            cache.get(s)
        except PitstopError as e:
            print(e)
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "named pipe (FIFO)" in r.stdout and "cached trial result" in r.stdout, r.stdout


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_lock_that_is_not_a_file_is_refused_by_name(kind, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    lock = out / runlock.LOCK_NAME
    os.mkfifo(lock) if kind == "fifo" else lock.mkdir()
    r = _child(f"""
        from pitstop.core import runlock
        from pitstop.core.errors import PitstopError
        print("holder", runlock.holder({str(out)!r}))
        try:
            runlock.acquire({str(out)!r})
        except PitstopError as e:
            print(e)
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    no_traceback(r.stderr)
    assert "holder None" in r.stdout  # a reader (report) is not stopped by it
    what = "a named pipe (FIFO)" if kind == "fifo" else "a directory"
    assert f"{lock} is {what}, not a regular file" in r.stdout, r.stdout
    assert f"rm -r {lock}" in r.stdout


def test_train_refuses_a_fifo_lock_with_one_paragraph(tmp_path, tiny_model_dir, rel_store):
    from _rel import run, train_cmd

    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / runlock.LOCK_NAME)
    r = run(train_cmd(tiny_model_dir, rel_store, out, steps=1))
    assert r.returncode == 1, r.stderr[-2000:]
    no_traceback(r.stderr)
    assert "is a named pipe (FIFO)" in r.stderr
    assert not (out / "checkpoints").exists()


def test_stale_lock_naming_another_live_process_does_not_block(tmp_path):
    """The pid in the file is now someone else's live process (pid reuse after a crash)."""
    out = tmp_path / "out"
    out.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (out / runlock.LOCK_NAME).write_text(f"{other.pid} {socket.gethostname()}\n")
        assert runlock.holder(out) is None  # nobody holds the flock: no run in progress
        with runlock.acquire(out):
            text = (out / runlock.LOCK_NAME).read_text()
            assert text.split()[0] == str(os.getpid()), "the holder line names the new holder"
            # And while held, a second writer is refused naming us, not the stale pid.
            with pytest.raises(runlock.RunInProgress, match=f"pid {os.getpid()},"):
                runlock.acquire(out)
    finally:
        other.kill()
        other.wait()


def test_stale_lock_naming_ourselves_does_not_pass_as_ours(tmp_path, monkeypatch):
    """A file naming a pid equal to PITSTOP_RUN_LOCK but not flocked is simply free."""
    out = tmp_path / "out"
    out.mkdir()
    (out / runlock.LOCK_NAME).write_text(f"{os.getppid()} {socket.gethostname()}\n")
    monkeypatch.setenv(runlock.HELD_ENV, str(os.getppid()))
    lk = runlock.acquire(out)
    try:
        assert lk.fd is not None, "an unheld lock must be taken for real, not as a no-op"
    finally:
        lk.release()


def test_not_a_regular_file_is_a_pitstop_error():
    assert issubclass(NotARegularFile, runlock.PitstopError)
    assert NotARegularFile("x").exit_code == 1


def test_data_given_a_fifo_is_named_as_not_a_file(tmp_path: Path) -> None:
    """`--data` naming a FIFO read as "the file is empty" (its size is 0): misleading."""
    from pitstop.core.errors import DataError
    from pitstop.data.readers import check_file

    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="is not a regular file"):
        check_file(fifo)
