"""An interrupted `pitstop prepare` leaves nothing that opens as a store, and the same
command again restarts cleanly and writes the store an uninterrupted prepare writes.

Beside tests/test_data_cache.py (an exception mid-write, a SIGKILLed library call) and
tests/reliability/test_signals_again.py (SIGINT/SIGTERM/SIGKILL of the CLI, the rerun
succeeds, no worker outlives it), these check what those do not: the rerun's store is
byte for byte the uninterrupted one's, the killed prepare's partial directory is refused
wherever a store is taken (`--data DIR`), the rerun removes it and says why, and a partial
directory a running prepare holds is never removed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pitstop.core.config import RunConfig
from pitstop.core.errors import DataError
from pitstop.data import prepare as prep
from pitstop.data.store import WRITTEN, TokenStore, is_store

REPO = Path(__file__).resolve().parents[2]
# Differ between two prepares of the same data: when, and how fast.
_TIMING = ("created", "prepare_seconds", "tokens_per_second")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """~6 MB of JSONL: several 1 MiB chunks, so a kill lands while the store is written."""
    p = tmp_path_factory.mktemp("interrupt") / "data.jsonl"
    with p.open("w") as f:
        for i in range(20000):
            f.write(json.dumps({"text": f"record {i} " + "word " * 60}) + "\n")
    return p


@pytest.fixture(scope="module")
def reference(data, tiny_model_dir, tmp_path_factory) -> Path:
    """The store of an uninterrupted prepare (one process; the pool writes the same)."""
    cache = tmp_path_factory.mktemp("reference-cache")
    cfg = RunConfig(
        data=[str(data)], model=str(tiny_model_dir), cache_dir=str(cache), max_seq_len=64
    )
    return prep.prepare_data(cfg, progress=False).store_path


def _cmd(model: Path, data: Path, cache: Path) -> list[str]:
    return [sys.executable, "-m", "pitstop", "prepare", "--model", str(model), "--data",
            str(data), "--cache-dir", str(cache), "--max-seq-len", "64", "--workers", "2"]  # fmt: skip


def _env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("PITSTOP_TEST_")}
    e.update(TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def _interrupt(cmd: list[str], stores: Path, sig: signal.Signals, log: Path) -> int:
    """Run `cmd`, send `sig` once the store's partial directory holds tokens, return the code."""
    with log.open("w") as f:  # a file, not a pipe: nothing can block on reading it
        proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=f)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            tokens = [p / "tokens.bin" for p in stores.glob("*.partial-*")]
            if any(t.is_file() and t.stat().st_size > 50_000 for t in tokens):
                break
            assert proc.poll() is None, "prepare ended before the signal: " + log.read_text()
            time.sleep(0.02)
        proc.send_signal(sig)
        return proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _same_store(a: Path, b: Path) -> None:
    ma, mb = TokenStore(a).manifest, TokenStore(b).manifest  # opened: checksums verified
    for m in (ma, mb):
        m.pop("created")
        for k in _TIMING[1:]:
            m["stats"].pop(k)
    assert a.name == b.name  # the same content key
    assert ma == mb
    for name in WRITTEN:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.slow
def test_sigkill_leaves_no_store_and_the_rerun_matches(data, reference, tiny_model_dir, tmp_path):
    cache = tmp_path / "cache"
    stores = cache / "stores"
    cmd = _cmd(tiny_model_dir, data, cache)
    code = _interrupt(cmd, stores, signal.SIGKILL, tmp_path / "killed.err")
    assert code == -signal.SIGKILL
    (left,) = stores.iterdir()  # its partial directory: a SIGKILL leaves it
    assert ".partial-" in left.name and not is_store(left)
    with pytest.raises(DataError, match=r"no manifest\.json"):  # as `train --data DIR` takes it
        prep.prepare_data(RunConfig(data=[str(left)], model=str(tiny_model_dir)), progress=False)
    with pytest.raises(DataError, match="not a pitstop token store"):
        TokenStore(left)

    # Seconds old, but its writer's pid (in its name) is dead and nobody holds its lock:
    # removed at once, and said so (tests/reliability/test_prepare_faults.py: issue 45).
    again = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "was interrupted" in again.stderr and "preparing from the start" in again.stderr
    assert [p.name for p in stores.iterdir()] == [reference.name]  # the leftover is gone
    _same_store(stores / reference.name, reference)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"]
)
def test_sigint_removes_its_partial_and_the_rerun_matches(
    sig, code, data, reference, tiny_model_dir, tmp_path
):
    cache = tmp_path / "cache"
    stores = cache / "stores"
    cmd = _cmd(tiny_model_dir, data, cache)
    got = _interrupt(cmd, stores, sig, tmp_path / "stopped.err")
    assert got == code, (tmp_path / "stopped.err").read_text()[-3000:]
    assert list(stores.iterdir()) == []  # stopped through its cleanup: the partial removed
    again = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "interrupted" not in again.stderr  # nothing was left to clean
    _same_store(stores / reference.name, reference)


def test_a_held_partial_is_kept_and_a_dead_one_removed(tmp_path, capsys):
    """The lock, not the age alone, decides: a running prepare's directory is never taken."""
    stores = tmp_path / "stores"
    left = stores / "abc.partial-0001"
    left.mkdir(parents=True)
    (left / "tokens.bin").write_bytes(b"\0" * (3 << 20))
    other = stores / "xyz.partial-0002"  # another store's: not this prepare's business
    other.mkdir()
    old = time.time() - 2 * prep._CLAIM_GRACE_SECONDS
    for p in (left, other):
        os.utime(p, (old, old))
    with prep._claim(left):  # as the prepare writing it holds it
        prep._leftovers(stores, "abc", progress=True)
        assert left.is_dir()
    assert "another prepare of the same data is running" in capsys.readouterr().err
    prep._leftovers(stores, "abc", progress=True)
    assert not left.exists() and other.is_dir()
    err = capsys.readouterr().err
    assert "interrupted after writing 3.0 MiB" in err and "abc.partial-0001" in err
