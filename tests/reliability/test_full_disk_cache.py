"""A full disk under the cache: mid-prepare and mid-checkpoint, the cache stays usable.

test_fs_faults.py checks the message of a prepare that fills its disk, and
test_disk_full.py the previous checkpoint of a run whose disk fills; here the cache shares
the small tmpfs with what fills it, and the question is what survives: a store prepared
before stays whole and is a cache hit, nothing partial is left, and the run directory's
previous checkpoint resumes once there is room. Needs `unshare -m` and a tmpfs mount
(root, or a user namespace); skipped where the machine allows neither.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _rel import env, no_traceback, train_cmd

pytestmark = pytest.mark.slow


def _namespace_ok(tmp: Path) -> str | None:
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    d = tmp / "probe"
    d.mkdir()
    flags = "-m" if os.geteuid() == 0 else "-rm"
    r = subprocess.run(["unshare", flags, "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {d}"],
                       capture_output=True, text=True)  # fmt: skip
    return None if r.returncode == 0 else f"cannot mount a tmpfs here: {r.stderr.strip()}"


def _dataset(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"text": f"record {i} " + "word " * 60}) + "\n"
                            for i in range(n)))  # fmt: skip
    return path


def _prepare(model: Path, data: Path, cache: Path) -> str:
    return shlex.join([sys.executable, "-m", "pitstop", "prepare", "--model", str(model),
                       "--data", str(data), "--cache-dir", str(cache), "--max-seq-len", "64",
                       "--workers", "1"])  # fmt: skip


def _in_namespace(script: str) -> subprocess.CompletedProcess:
    flags = "-m" if os.geteuid() == 0 else "-rm"
    return subprocess.run(["unshare", flags, "sh", "-c", script], env=env(),
                          capture_output=True, text=True, timeout=600)  # fmt: skip


@pytest.fixture(scope="module")
def filled(tiny_model_dir, tmp_path_factory) -> Path:
    """A cache on a 256 KB tmpfs: a small prepare, a big one that fills the disk, the small
    one again; the cache copied out afterwards (`saved`), each command's output in `logs`."""
    tmp_path = tmp_path_factory.mktemp("filled")
    why = _namespace_ok(tmp_path)
    if why:
        pytest.skip(why)
    cache, logs = tmp_path / "cache", tmp_path / "logs"
    cache.mkdir()
    logs.mkdir()
    small = _dataset(tmp_path / "small.jsonl", 200)  # ~40 KB of arrays: fits
    big = _dataset(tmp_path / "big.jsonl", 3000)  # ~570 KB: does not
    steps = [
        ("small", _prepare(tiny_model_dir, small, cache)),
        ("big", _prepare(tiny_model_dir, big, cache)),
        ("again", _prepare(tiny_model_dir, small, cache)),  # on the still-full disk
    ]
    script = f"mount -t tmpfs -o size=256k tmpfs {cache}"
    for name, cmd in steps:
        script += f"; {cmd} > {logs / name}.out 2> {logs / name}.err; echo $? > {logs / name}.rc"
    script += f"; cp -a {cache} {tmp_path / 'saved'}"
    r = _in_namespace(script)
    assert r.returncode == 0, r.stderr[-2000:]
    return tmp_path


def _rc(d: Path, name: str) -> int:
    return int((d / "logs" / f"{name}.rc").read_text())


def test_full_disk_mid_prepare_keeps_the_cache_usable(filled):
    logs, saved = filled / "logs", filled / "saved"
    assert _rc(filled, "small") == 0, (logs / "small.err").read_text()[-2000:]
    err = (logs / "big.err").read_text()
    assert _rc(filled, "big") == 1, err[-3000:]
    no_traceback(err)
    assert "no space left on the device" in err and "Nothing was added to the cache" in err
    assert _rc(filled, "again") == 0, (logs / "again.err").read_text()[-2000:]
    stores = [p for p in (saved / "stores").iterdir() if ".partial-" not in p.name]
    (store,) = stores
    from pitstop.data.store import TokenStore

    assert len(TokenStore(store)) > 0  # whole: sizes and checksums match the manifest
    assert str(store.name) in (logs / "again.out").read_text()
    for p in (saved / "fingerprints").iterdir():  # every memo a whole digest
        assert len(p.read_text().strip()) == 40, p


def test_full_disk_mid_prepare_leaves_no_partial_store(filled):
    stores = list((filled / "saved" / "stores").iterdir())
    assert [p.name for p in stores if ".partial-" in p.name] == [], "the partial store stayed"


def cmd_cache(model: Path, store: Path) -> Path:
    """The measured-choice cache `train_cmd` gives a store's runs (and their reference)."""
    cmd = train_cmd(model, store, store.parent / "unused")
    return Path(cmd[cmd.index("--cache-dir") + 1])


def test_full_disk_mid_checkpoint_with_the_cache_on_it(
    tiny_model_dir, rel_store, reference, tmp_path
):
    """The run directory and the measured-choice cache on one tmpfs that the second
    checkpoint fills: the first checkpoint and every cache entry stay whole, and the run
    resumes from that checkpoint once there is room."""
    why = _namespace_ok(tmp_path)
    if why:
        pytest.skip(why)
    disk, saved = tmp_path / "disk", tmp_path / "saved"
    disk.mkdir()
    out, cache = disk / "out", disk / "cache"
    cmd = train_cmd(tiny_model_dir, rel_store, out)
    cmd[cmd.index("--cache-dir") + 1] = str(cache)
    one = sum(p.stat().st_size for p in (reference / "checkpoints" / "step-8").rglob("*"))
    size_kb = int(one * 1.5) // 1024
    # The reference's measured choices (the CPU precision) come along: measured afresh on
    # a loaded machine they can come out the other way, and the losses then differ from the
    # reference for a reason that is not the full disk (once in CI).
    shared = cmd_cache(tiny_model_dir, rel_store)
    script = (
        f"mount -t tmpfs -o size={size_kb}k tmpfs {disk} && "
        f"cp -a {shlex.quote(str(shared))} {shlex.quote(str(cache))} && "
        f"{{ {shlex.join(cmd)} 2> {tmp_path / 'err.txt'}; echo $? > {tmp_path / 'rc.txt'}; }}; "
        f"cp -a {disk} {saved}"
    )
    r = _in_namespace(script)
    assert r.returncode == 0, r.stderr[-2000:]
    stderr = (tmp_path / "err.txt").read_text()
    assert int((tmp_path / "rc.txt").read_text()) == 1, stderr[-3000:]
    no_traceback(stderr)
    from _rel import assert_same_as, check_accepted_checkpoints, run

    s_out, s_cache = saved / "out", saved / "cache"
    assert check_accepted_checkpoints(s_out) == [2]
    assert not [p for p in (s_out / "checkpoints").iterdir() if p.name.startswith(".")]
    for p in s_cache.rglob("*"):
        assert ".tmp-" not in p.name, f"a temporary cache file was left: {p}"
        if p.suffix == ".json":
            json.loads(p.read_text(encoding="utf-8"))  # whole
    # With room (the copy is on the ordinary disk), resume from step 2 with the same cache.
    resumed = train_cmd(tiny_model_dir, rel_store, s_out)
    resumed[resumed.index("--cache-dir") + 1] = str(s_cache)
    done = run([*resumed, "--resume"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_as(s_out, reference)
