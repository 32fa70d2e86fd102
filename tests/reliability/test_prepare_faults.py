"""Issue 45: the last tracebacks and leftovers of `pitstop prepare` under faults.

- Ctrl-C (SIGINT to the whole process group, as a terminal sends it) or SIGTERM to the group
  while the pool's workers wait for work: the parent prints its one line, and no worker
  prints a traceback (they used to inherit the parent's handler and raise `Stopped` inside
  `concurrent.futures`' `call_queue.get`). The prepare is held at the `prepare-chunk` fault
  point after its only chunk, so every worker is idle when the signal lands.
- A file-size limit (`ulimit -f`: EFBIG, "File too large") mid-write is one clear error
  naming the limit, not a traceback, and leaves no partial store.
- A SIGKILLed prepare's partial store is removed by the next prepare into that cache at
  once (its writer's pid is dead and nobody holds its lock), not a day later.
- A record whose rendering passes `--max-record-seconds` (a chat template that would run
  for hours) is skipped and counted, in one process and through the pool, and the store
  is byte for byte the one of the same data without that record; a run with no slow
  record writes the same store whatever the limit.
- While the pool waits for a chunk, the progress bar keeps showing records per second.

No test here depends on the machine's speed: the slow record takes minutes by itself (10^9
template loop iterations) against a limit of 2 s, every other record renders in
microseconds, and the waits are on gates and fault points.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _rel import KILLED, env, held, hold_at, no_traceback

from pitstop.data import prepare as prep
from pitstop.data import tokenize
from pitstop.data.store import WRITTEN, TokenStore, is_store


def _lines(n: int, start: int = 0) -> str:
    return "".join(json.dumps({"text": f"record {i} " + "word " * 60}) + "\n"
                   for i in range(start, start + n))  # fmt: skip


def _cmd(model: Path, data: Path, cache: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pitstop", "prepare", "--quiet", "--model", str(model),
            "--data", str(data), "--cache-dir", str(cache), "--max-seq-len", "64",
            *extra]  # fmt: skip


def _children(pid: int) -> list[int]:
    r = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# --- a stop signal to the process group while the workers wait ------------------------


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_to_the_group_while_workers_wait_prints_one_line(
    sig, tiny_model_dir, tmp_path
):
    data = tmp_path / "d.jsonl"
    data.write_text(_lines(20))  # one chunk: after it, both workers wait for work
    gate, cache = tmp_path / "gate", tmp_path / "cache"
    cmd = _cmd(tiny_model_dir, data, cache, "--workers", "2")
    with (tmp_path / "err").open("w") as f:  # a file: a stray worker could hold a pipe open
        proc = subprocess.Popen(cmd, env=env(**hold_at("prepare-chunk:1", gate)),
                                stdout=subprocess.DEVNULL, stderr=f,
                                start_new_session=True)  # fmt: skip
    workers: list[int] = []
    try:
        while not held(gate):
            assert proc.poll() is None, (tmp_path / "err").read_text()[-3000:]
            time.sleep(0.01)
        workers = _children(proc.pid)
        os.killpg(proc.pid, sig)  # the whole group, as Ctrl-C in a terminal
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
    err = (tmp_path / "err").read_text()
    assert proc.returncode == 128 + sig, err[-3000:]
    name = signal.Signals(sig).name
    assert err.splitlines() == [
        f"pitstop prepare: {name} stopped the prepare: nothing was published to the cache; "
        "run it again"
    ], err[-3000:]
    assert len(workers) == 2, workers
    assert not [w for w in workers if _alive(w)], "a tokenizer worker outlived the prepare"
    assert list((cache / "stores").iterdir()) == []  # stopped through its cleanup


# A worker that writes the first bytes of a result message and stops there, as a worker
# killed in the middle of sending its result does; the pool's manager thread then waits for
# the rest. Run in a fresh process: a pool that hangs would hang pytest's exit too.
_HALF_A_RESULT = """
import os, struct, sys, time
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from pitstop.core import forked_workers

def half_a_result(fd):
    os.write(fd, struct.pack("!i", 1 << 20) + b"only the start")  # 1 MiB promised
    time.sleep(600)

ex = ProcessPoolExecutor(1, mp_context=mp.get_context("fork"))
fut = ex.submit(half_a_result, ex._result_queue._writer.fileno())
time.sleep(1.0)  # the manager thread is in recv(), waiting for the rest
forked_workers.end_workers(ex)
ex.shutdown(wait=True, cancel_futures=True)
print("shut down:", type(fut.exception()).__name__)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="fork")
def test_a_worker_killed_mid_result_does_not_hang_the_stop(tmp_path):
    """The CI failure of 2026-11-28: SIGTERM to `prepare --workers 2` hung for 120 s, its
    pool's manager thread in `recv()` of a result its killed worker had half sent."""
    script = tmp_path / "half.py"
    script.write_text(_HALF_A_RESULT)
    proc = subprocess.Popen([sys.executable, str(script)], env=env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and its sleeping worker
        proc.communicate()
        pytest.fail("the pool's shutdown hung after its workers were terminated")
    assert proc.returncode == 0, err[-3000:]
    assert out.strip() == "shut down: BrokenProcessPool", out + err


# --- a file-size limit ----------------------------------------------------------------


def test_a_file_size_limit_is_a_clean_refusal(tiny_model_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(_lines(2000))  # ~250 KB of tokens: past a 64 KiB file-size limit
    cache = tmp_path / "cache"

    def limit() -> None:  # as `ulimit -f 64` in the shell that starts it
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))

    r = subprocess.run(_cmd(tiny_model_dir, data, cache, "--workers", "2"), env=env(),
                       capture_output=True, text=True, timeout=300,
                       preexec_fn=limit)  # fmt: skip
    assert r.returncode == 1, r.stderr[-3000:]
    no_traceback(r.stderr)
    err = " ".join(r.stderr.split())
    assert err.startswith(f"pitstop prepare: error: while writing under {cache}: "), err
    assert "larger than this process may write (EFBIG" in err and "ulimit -f" in err, err
    assert "Nothing was added to the cache" in err, err
    assert list((cache / "stores").iterdir()) == [], "the partial store stayed"


# --- a SIGKILLed prepare's partial store ------------------------------------------------


def test_a_sigkilled_prepare_leaves_nothing_after_the_next_one(tiny_model_dir, tmp_path, capsys):
    from pitstop.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text(_lines(20))
    cache = tmp_path / "cache"
    stores = cache / "stores"
    cmd = _cmd(tiny_model_dir, data, cache, "--workers", "2")
    killed = subprocess.run(cmd, env=env(PITSTOP_TEST_DIE_AT="prepare-chunk:1"),
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert killed.returncode == KILLED, killed.stderr[-3000:]
    (left,) = stores.iterdir()
    assert ".partial-" in left.name and not is_store(left)
    # The same command again at once (in this process: a CLI start costs seconds), with
    # its notices (INFO) shown.
    assert main([a for a in cmd[3:] if a != "--quiet"]) == 0
    err = capsys.readouterr().err
    no_traceback(err)
    assert "interrupted after writing" in err and f"removed {left.name}" in err, err[-3000:]
    (store,) = stores.iterdir()  # the seconds-old leftover is gone, not kept for a day
    assert is_store(store) and TokenStore(store).manifest["stats"]["documents"] == 20


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_leftovers_go_on_the_pid_and_the_lock_only(tmp_path, capsys):
    """Unlocked with a dead writer: removed at once, this store's or another's. Unlocked
    with a live writer (between making its directory and locking it), or locked: kept."""
    stores = tmp_path / "stores"
    dead = _dead_pid()
    mine_dead = stores / f"abc.partial-{dead}-0a0b"
    other_dead = stores / f"xyz.partial-{dead}-0c0d"
    mine_live = stores / f"abc.partial-{os.getppid()}-0e0f"  # young, its writer alive
    locked = stores / f"abc.partial-{dead}-1a1b"
    for p in (mine_dead, other_dead, mine_live, locked):
        p.mkdir(parents=True)
        (p / "tokens.bin").write_bytes(b"\0" * (1 << 20))
    with prep._claim(locked):
        prep._leftovers(stores, "abc", progress=True)
    assert sorted(p.name for p in stores.iterdir()) == sorted([mine_live.name, locked.name])
    err = capsys.readouterr().err
    assert f"removed {mine_dead.name} and preparing from the start" in err
    assert f"removed {other_dead.name} (1.0 MiB)" in err
    assert err.count("another prepare of the same data is running") == 2


# --- a record over --max-record-seconds ----------------------------------------------------

# Renders the message "slow" with 10^9 loop iterations: minutes on any machine (2.5 on the
# 2-core dev box, 10^6 take 0.15 s), so only the limit ends it within seconds; were the
# limit broken, the test would fail after those minutes, not hang. Every other message
# renders in microseconds.
_SLOW_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] == 'slow' %}{% for a in range(100000) %}"
    "{% for b in range(10000) %}{% endfor %}{% endfor %}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def slow_model(tiny_model_dir, tmp_path_factory) -> Path:
    model = tmp_path_factory.mktemp("slow") / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = _SLOW_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    return model


def _chats(path: Path, slow_at: int | None) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": "slow" if i == slow_at else f"a {i}"}]}
            for i in range(40)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prepare(model: Path, data: Path, cache: Path, *extra: str, capsys) -> tuple[str, str, Path]:
    from pitstop.cli import main

    rc = main(["prepare", "--model", str(model), "--data", str(data), "--cache-dir", str(cache),
               *extra])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    no_traceback(err)
    return out, err, next(p for p in (cache / "stores").iterdir())


@pytest.mark.parametrize("workers", ["1", "2"], ids=["one-process", "pool"])
def test_a_record_over_max_record_seconds_is_skipped_and_counted(
    workers, slow_model, tmp_path, capsys
):
    # The one-process path renders in this thread: the limit's timer needs the main one.
    assert threading.current_thread() is threading.main_thread()
    data = _chats(tmp_path / "chats.jsonl", slow_at=7)
    out, err, store = _prepare(slow_model, data, tmp_path / "c", "--workers", workers,
                               "--max-record-seconds", "2", capsys=capsys)  # fmt: skip
    where = f"{data}:8"
    assert "slow records                  1   (skipped: still rendering after 2 s" in out
    assert f"    {where}: a chat of 2 messages" in out
    assert (
        f"1 record skipped: still rendering after 2 s (--max-record-seconds) (first: {where}"
        in " ".join(err.split())
    )
    stats = TokenStore(store).manifest["stats"]
    assert stats["slow_records"]["count"] == 1 and stats["documents"] == 39
    assert stats["records_read"] == 40 and stats["bad_records"] == 0
    # Skipping it is as if it were not there: the store of the data without that line.
    lines = data.read_text().splitlines(keepends=True)
    without = tmp_path / "without.jsonl"
    without.write_text("".join(lines[:7] + lines[8:]))
    *_, plain = _prepare(slow_model, without, tmp_path / "c2", "--workers", workers,
                         "--max-record-seconds", "2", capsys=capsys)  # fmt: skip
    for name in WRITTEN:
        assert (store / name).read_bytes() == (plain / name).read_bytes(), name


def test_no_slow_record_means_the_same_store_whatever_the_limit(slow_model, tmp_path, capsys):
    data = _chats(tmp_path / "chats.jsonl", slow_at=None)
    *_, default = _prepare(slow_model, data, tmp_path / "a", capsys=capsys)
    *_, unlimited = _prepare(slow_model, data, tmp_path / "b", "--max-record-seconds", "0",
                             capsys=capsys)  # fmt: skip
    for name in WRITTEN:
        assert (default / name).read_bytes() == (unlimited / name).read_bytes(), name
    # The default keeps the key stores had before the limit existed; another limit is
    # another key (a store missing a skipped record must not answer for one that waits).
    assert "max_record_seconds" not in TokenStore(default).manifest["options"]
    assert default.name != unlimited.name


def test_the_limit_interrupts_in_the_main_thread_and_skips_afterwards_elsewhere():
    """The timer ends a rendering that would never end; where it cannot be used (another
    thread, or the program's own SIGALRM timer) a record over the limit is still skipped,
    once it is done, so where prepare runs does not change the store."""
    from pitstop.data.time_limit import RecordTimeout, RenderLimit

    assert threading.current_thread() is threading.main_thread()
    with RenderLimit(0.05) as limit:
        with pytest.raises(RecordTimeout), limit.record():
            while True:  # stands for a template that would run for hours
                time.sleep(0.001)
        with limit.record():
            pass  # a quick record after it is kept: the timer was disarmed
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL  # the handler is restored

    def slow_then_quick(out: list) -> None:
        with RenderLimit(0.05) as limit:
            try:
                with limit.record():
                    time.sleep(0.2)  # at least 0.2 s, past the limit however fast the box
            except RecordTimeout:
                out.append("skipped")
            with limit.record():
                out.append("kept")

    out: list[str] = []
    t = threading.Thread(target=slow_then_quick, args=(out,))
    t.start()
    t.join(60)
    assert out == ["skipped", "kept"]
    # The program's own timer is left alone (and the limit then applies afterwards).
    signal.signal(signal.SIGALRM, lambda *_: None)
    try:
        signal.setitimer(signal.ITIMER_REAL, 100)
        out.clear()
        slow_then_quick(out)
        assert out == ["skipped", "kept"] and signal.getitimer(signal.ITIMER_REAL)[0] > 90
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


# --- the progress bar while the pool waits ---------------------------------------------------

_REAL_PROCESS_CHUNK = tokenize.process_chunk


def _gated_process_chunk(chunk):
    """process_chunk once the test's gate exists (at most 60 s: a broken test still ends)."""
    gate = Path(os.environ["PITSTOP_REL_GATE"])
    deadline = time.monotonic() + 60
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return _REAL_PROCESS_CHUNK(chunk)


def test_the_bar_shows_records_per_second_while_the_pool_waits(
    tiny_model_dir, tmp_path, monkeypatch
):
    import tqdm as tqdm_module

    from pitstop.core.config import RunConfig
    from pitstop.data import pool

    postfixes: list[tuple[int, str]] = []  # (bar position, postfix)

    class Recorder(tqdm_module.tqdm):
        def __init__(self, *a, **k):
            k["disable"] = False
            super().__init__(*a, **k)

        def set_postfix_str(self, s="", refresh=True):
            postfixes.append((self.n, s))
            return super().set_postfix_str(s, refresh)

    gate = tmp_path / "gate"
    monkeypatch.setenv("PITSTOP_REL_GATE", str(gate))
    monkeypatch.setattr(tokenize, "process_chunk", _gated_process_chunk)
    monkeypatch.setattr(tqdm_module, "tqdm", Recorder)
    monkeypatch.setattr(pool, "TICK_SECONDS", 0.05)

    def open_gate_once_the_bar_moves_while_waiting() -> None:
        deadline = time.monotonic() + 60
        while not postfixes and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.touch()

    opener = threading.Thread(target=open_gate_once_the_bar_moves_while_waiting, daemon=True)
    opener.start()
    data = tmp_path / "d.jsonl"
    data.write_text(_lines(20))
    cfg = RunConfig(data=[str(data)], model=str(tiny_model_dir), cache_dir=str(tmp_path / "c"),
                    max_seq_len=64, workers=2)  # fmt: skip
    prepared = prep.prepare_data(cfg, progress=True)
    opener.join(5)
    # The first refresh came while the only chunk was still out (nothing written yet),
    # and it shows a rate; the last one, after the chunk, counts all the records.
    assert postfixes and postfixes[0][0] == 0, postfixes
    assert postfixes[0][1] == "0 rec, 0.0 rec/s, 0 tok/s", postfixes
    assert postfixes[-1][1].startswith("20 rec, ") and " rec/s, " in postfixes[-1][1]
    assert prepared.stats["documents"] == 20
