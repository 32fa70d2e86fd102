"""Two commands on one cache or one run at once.

Two prepares of the same data on one cache: both succeed with the same store, published
once, whole. `tune` and `train` on one cache at once: both finish, and every cache file
either wrote is whole. `report` on a run that is training: it reads what is there (no
lock, no refusal) and the run goes on undisturbed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _rel import (
    env,
    held,
    hold_at,
    metric_lines,
    no_traceback,
    release,
    run,
    sigkill,
    start,
    train_cmd,
    wait_until,
)

pytestmark = pytest.mark.slow


def _prepare_cmd(model: Path, data: Path, cache: Path) -> list[str]:
    return [sys.executable, "-m", "pitstop", "prepare", "--model", str(model), "--data",
            str(data), "--cache-dir", str(cache), "--max-seq-len", "64", "--workers", "1"]  # fmt: skip


def _popen(cmd: list[str], **extra: str) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env(**extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def test_two_prepares_of_the_same_data_at_once(tiny_model_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"record {i} " + "word " * 40}) + "\n"
                            for i in range(3000)))  # fmt: skip
    cache = tmp_path / "cache"
    cmd = _prepare_cmd(tiny_model_dir, data, cache)
    procs = [_popen(cmd), _popen(cmd)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
        no_traceback(err)
    stores = sorted((cache / "stores").iterdir())
    assert [p.name for p in stores if p.name.startswith(".") or ".partial-" in p.name] == []
    assert len(stores) == 1, stores
    # Both name the one published store, and it is whole (its checksums verified).
    for out, _ in outs:
        assert str(stores[0].name) in out
    from pitstop.data.store import TokenStore

    assert len(TokenStore(stores[0])) > 0
    again = run(cmd)  # a cache hit on the store the two published
    assert again.returncode == 0, again.stderr[-2000:]
    assert sorted((cache / "stores").iterdir()) == stores


def test_tune_and_train_on_one_cache_at_once(tiny_model_dir, rel_store, tmp_path):
    cache = tmp_path / "cache"
    train = train_cmd(tiny_model_dir, rel_store, tmp_path / "out", steps=4)
    train[train.index("--cache-dir") + 1] = str(cache)
    tune = train_cmd(tiny_model_dir, rel_store, tmp_path / "run", steps=4)
    tune[3] = "tune"
    tune[tune.index("--output") + 1] = str(tmp_path / "tuned.yaml")
    tune[tune.index("--cache-dir") + 1] = str(cache)
    i = tune.index("--max-steps")
    del tune[i : i + 2]
    tune += ["--budget-seconds", "1", "--trial-steps", "3", "--trial-warmup", "1",
             "--knobs", "micro_batch"]  # fmt: skip
    procs = [_popen(train), _popen(tune, TMPDIR=str(tmp_path))]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        no_traceback(err)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["status"] == "completed"
    assert (tmp_path / "tuned.yaml").is_file()
    # Every cache file either process wrote is whole (atomic writes, random temp names).
    for p in cache.rglob("*.json"):
        json.loads(p.read_text(encoding="utf-8"))
    assert not [p for p in cache.rglob(".*.tmp-*")], "a temporary cache file was left"


def test_report_on_a_run_that_is_training(tiny_model_dir, rel_store, tmp_path, capsys):
    from pitstop.cli import main

    out, gate = tmp_path / "out", tmp_path / "gate"
    proc = start(train_cmd(tiny_model_dir, rel_store, out), **hold_at("ckpt-write:4", gate))
    try:
        assert wait_until(lambda: held(gate), proc, "the step-4 write")
        html = tmp_path / "report.html"
        capsys.readouterr()
        assert main(["report", str(out), "--output", str(html)]) == 0
        err = capsys.readouterr().err
        no_traceback(err)
        text = html.read_text(encoding="utf-8")
        assert "<html" in text.lower() and len(text) > 1000
        assert (out / ".lock").read_text().split()[0] == str(proc.pid), "the lock changed"
        release(gate)
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
    finally:
        sigkill(proc)
    assert [r["step"] for r in metric_lines(out)] == list(range(1, 9))
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"


class _LateDest(type(Path())):  # type: ignore[misc]
    """A destination that still looks absent at finish()'s check: the other writer
    publishes between that check and the rename (a window two real prepares rarely hit)."""

    def exists(self, *, follow_symlinks: bool = True) -> bool:
        return False


def test_two_writers_of_one_store_racing_at_the_rename(tmp_path, tiny_tokenizer):
    import numpy as np

    from pitstop.data.store import StoreWriter, TokenStore

    dest = tmp_path / "stores" / "key"
    writers = [StoreWriter(dest, vocab_size=len(tiny_tokenizer)) for _ in range(2)]
    for w in writers:
        w.append(np.arange(10), np.ones(10, np.uint8), [10], [0])
    writers[0].finish({"max_seq_len": 64})
    writers[1].dest = _LateDest(dest)
    assert writers[1].finish({"max_seq_len": 64}) == dest
    assert len(TokenStore(dest)) == 1
    assert [p.name for p in dest.parent.iterdir()] == ["key"], "a partial store was left"
