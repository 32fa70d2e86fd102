"""Keeping freed host memory (pitstop/core/host_malloc.py, `keep_freed_memory`).

The truth is the kernel's own count of minor page faults (getrusage), not pitstop's: a
process that allocates, fills and frees a 64 MiB tensor again and again faults its pages
in every time under glibc's defaults, and not once after `keep_freed`. Each check runs in
a fresh process: the setting is process-wide and cannot be undone.
"""

from __future__ import annotations

import io
import json
import platform
import subprocess
import sys
import textwrap
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from pitstop.core import host_malloc
from pitstop.probe import Choice, DeviceInfo, apply_host_memory, choose_host_memory

ROOT = Path(__file__).resolve().parents[1]
CPU = DeviceInfo(type="cpu", name="cpu")
GPU = DeviceInfo(type="cuda", name="gpu", capability=(9, 0), bf16=True)


@pytest.fixture(autouse=True)
def _fresh_process_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """An earlier in-process run in this test worker may have kept freed memory; these
    tests decide as a fresh process would (the one that tests that case sets it back)."""
    monkeypatch.setattr(host_malloc, "_kept", False)


_FAULTS = textwrap.dedent(
    """
    import json, sys
    import torch
    from pitstop.core import host_malloc

    def rss_mib():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) // 1024 for l in f if l.startswith("VmRSS:"))

    def faults_per_fill(n):
        before = host_malloc.minor_faults()
        for _ in range(n):
            t = torch.empty(1 << 24)  # 64 MiB of fp32, as a step's large tensor
            t.fill_(1.0)
            del t
        return (host_malloc.minor_faults() - before) / n

    faults_per_fill(2)  # the first allocations' pages are not counted
    out = {"default": faults_per_fill(6)}
    if sys.argv[1] == "keep":
        out["problem"] = host_malloc.keep_freed()
        out["settling"] = faults_per_fill(20)
        out["rss_settled"] = rss_mib()
        out["kept"] = faults_per_fill(10)
        out["rss_end"] = rss_mib()
    print(json.dumps(out))
    """
)


def _faults(mode: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc",
    reason="mallopt is glibc's (the choice says so elsewhere: test_not_glibc_is_said)",
)
def test_kept_freed_memory_is_not_faulted_in_again() -> None:
    """glibc's best fit lets small allocations split a freed block, so the heap grows for
    the first few repeats (measured: 8) before every repeat finds its block again: from
    then on, no page faults and no growth."""
    got = _faults("keep")
    pages = (1 << 26) // 4096  # a 64 MiB tensor's 4 KiB pages
    assert got["default"] > pages / 2, got  # glibc handed the block back, so it faulted in
    assert got["problem"] is None
    assert got["kept"] < pages / 50, got  # reused from the heap: (almost) no page faults
    assert got["rss_end"] - got["rss_settled"] < 64, got  # and the heap stopped growing


def test_auto_keeps_freed_memory_on_a_cpu_run_only() -> None:
    on = choose_host_memory("auto", CPU, environ={})
    assert on.value is True and "CPU training" in on.reason
    assert choose_host_memory("auto", GPU, environ={}).value is False
    assert choose_host_memory("on", GPU, environ={}).value is True  # asked for
    off = choose_host_memory("off", CPU, environ={})
    assert off.value is False and "--keep-freed-memory off" in off.reason


@pytest.mark.parametrize(
    "environ",
    [
        {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
        {"LD_PRELOAD": "libtcmalloc_minimal.so.4"},
        {"MALLOC_MMAP_THRESHOLD_": "65536"},
        {"MALLOC_TRIM_THRESHOLD_": "0"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
    ],
)
def test_the_processs_own_allocator_setting_is_kept(environ: dict[str, str]) -> None:
    for requested in ("auto", "on"):
        c = choose_host_memory(requested, CPU, environ=environ)
        assert c.value is False
        assert next(iter(environ)) in c.reason  # names what it kept


def test_an_unrelated_preload_does_not_count() -> None:
    assert choose_host_memory("auto", CPU, environ={"LD_PRELOAD": "libfoo.so"}).value is True
    assert host_malloc.own_allocator_setting({"GLIBC_TUNABLES": "glibc.cpu.x86_shstk=on"}) is None


def test_a_process_that_already_keeps_freed_memory_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """An earlier run in the process kept freed memory: mallopt cannot be undone, so `off`
    (or a GPU run's `auto`) says the memory is still kept, and how to get the defaults."""
    monkeypatch.setattr(host_malloc, "_kept", True)
    for requested, dev in (("off", CPU), ("auto", GPU)):
        c = choose_host_memory(requested, dev, environ={})
        assert c.value is True and "earlier run in this process" in c.reason
    monkeypatch.setattr(host_malloc, "_kept", False)  # a fresh process: off is off
    assert choose_host_memory("off", CPU, environ={}).value is False


def test_not_glibc_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_malloc.platform, "libc_ver", lambda: ("", ""))
    monkeypatch.setattr(host_malloc.platform, "system", lambda: "Darwin")
    got = apply_host_memory(Choice(True, "CPU training"))
    assert got.value is False and "not glibc (Darwin)" in got.reason
    off = Choice(False, "--keep-freed-memory off")
    assert apply_host_memory(off) is off  # nothing to do, nothing changed


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_cpu_run_keeps_freed_memory_and_its_summary_counts_the_faults(tiny_model_dir, tmp_path):
    """`pitstop train` on the CPU keeps freed memory by default (the banner's choice), and
    summary.json's faults per step, the kernel's own count, fall far below the same run's
    with `--keep-freed-memory off` (each run its own process: the setting is process-wide)."""
    from _train_util import make_store
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    store = make_store(tmp_path / "store", tok, n_docs=30, max_len=512)

    def train(keep: str) -> dict:
        out = tmp_path / f"out-{keep}"
        cmd = [
            sys.executable, "-m", "pitstop", "train", "--model", str(tiny_model_dir),
            "--data", str(store), "--output", str(out), "--max-seq-len", "512",
            "--tokens-per-step", "2048", "--micro-batch-size", "2", "--max-steps", "12",
            "--log-steps", "3", "--report-to", "none", "--compile", "off",
            "--precision", "fp32", "--cache-dir", str(tmp_path / "cache"),
        ]  # fmt: skip
        if keep != "auto":
            cmd += ["--keep-freed-memory", keep]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads((out / "summary.json").read_text())

    kept, default = train("auto"), train("off")
    assert kept["choices"]["host_memory"]["value"] is True
    assert default["choices"]["host_memory"]["value"] is False
    assert default["host_page_faults_per_step"] > 1000, default["host_page_faults_per_step"]
    # The heap settles over the first steps (test_kept_freed_memory_is_not_faulted_in_again)
    assert kept["host_page_faults_per_step"] < default["host_page_faults_per_step"] / 4
    assert kept["final_loss"] == default["final_loss"]  # the same math, bit for bit


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's environment variables")
def test_the_doctor_names_a_scripts_page_faults_and_a_second_run_without_them_agrees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pitstop profile -- python loop.py` of a plain loop whose 32 MiB logits glibc hands
    back every step: the finding names the faults and the fix; the same loop started with
    the fix's environment (a second run without the cause) faults far less, the kernel's own
    count, and gets no finding."""
    from pitstop import cli
    from pitstop.advise.rules.memory import GLIBC_KEEP_ENV

    def profile(name: str) -> tuple[dict, list[dict]]:
        cmd = [sys.executable, str(ROOT / "examples" / "faulting_loop.py"), "--steps", "30"]
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()) as err:
            rc = cli.main(["profile", "--output", str(tmp_path / name), "--", *cmd])
        assert rc == 0, err.getvalue()[-3000:]
        prof = json.loads((tmp_path / name / "pitstop_profile.json").read_text())
        return prof, json.loads((tmp_path / name / "findings.json").read_text())["findings"]

    first, found = profile("default")
    faults = first["host_page_faults_per_step"]
    assert faults > 3 * 8192, faults  # the logits, their gradient, the softmax: 32 MiB each
    assert first["page_fault_seconds"] > 0
    (f,) = [f for f in found if f["id"] == "host-page-faults"]
    assert GLIBC_KEEP_ENV in f["fix"] and f["evidence"]["page_faults_per_step"] == round(faults)
    for name, value in host_malloc.KEEP_ENV.items():
        monkeypatch.setenv(name, value)
    second, found = profile("kept")
    assert second["host_page_faults_per_step"] < faults / 5, second["host_page_faults_per_step"]
    assert not [f for f in found if f["id"] == "host-page-faults"]


def test_one_slow_refill_does_not_read_as_free_faults(monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy machine slowed one refill to nearly its fresh fill (a CI run): the fault's
    cost is still the fastest fresh fill less the fastest refill, not that one difference
    near zero, which hid the finding."""
    import types

    # Per try: the fresh fill's start and end, then two refills' (milliseconds).
    fills = [(9.0, 8.9, 8.9)] + [(9.0, 2.0, 2.1)] * 4  # the first try's refills were slowed
    ticks = iter([t / 1e3 for fresh, *again in fills for d in (fresh, *again) for t in (0.0, d)])
    monkeypatch.setattr(
        host_malloc, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks))
    )
    counts = iter([0, 8192] * 5)
    monkeypatch.setattr(host_malloc, "minor_faults", lambda: next(counts))
    assert host_malloc.page_fault_seconds() == pytest.approx((9.0 - 2.0) / 1e3 / 8192)


def test_no_fault_counted_is_no_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory the kernel did not fault in (huge pages, a kept heap) gives no cost at all,
    and the doctor's finding has nothing to multiply."""
    monkeypatch.setattr(host_malloc, "minor_faults", lambda: 0)
    assert host_malloc.page_fault_seconds() is None
