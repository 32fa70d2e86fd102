"""`python -m bench.gpu_selftest`: a clean "no CUDA device" exit on the CPU, the checks that
can run here do (the sliding-window check above all), a planted fault turns a row red,
and on a GPU every check passes (`pytest -m gpu`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
WINDOWED = ("mistral", "gemma3_text", "phi3")


def _selftest(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "bench.gpu_selftest", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip


def test_without_cuda_it_says_so_and_exits_cleanly() -> None:
    r = _selftest()
    assert r.returncode == 0, r.stderr[-2000:]
    assert "no CUDA device" in r.stdout
    assert "Traceback" not in r.stderr


def test_the_window_check_runs_on_the_cpu_with_a_row_per_windowed_config() -> None:
    r = _selftest("--cpu", "--only", "window")
    assert r.returncode in (0, 1), r.stderr[-2000:]
    rows = {
        line.split("  ")[0].strip(): line
        for line in r.stdout.splitlines()
        if line.startswith("sliding window: ")
    }
    for name in WINDOWED:
        line = rows[f"sliding window: {name}"]
        assert " pass " in line or " FAIL " in line, line
        assert "sdpa_docs fp32" in line and "raised" not in line, line
    assert not any(line.startswith("packed attention") for line in r.stdout.splitlines())


def test_a_kernel_that_ignores_the_window_fails_the_window_rows() -> None:
    """The check can fail: sdpa_docs with its window dropped leaks past the window."""
    from transformers import AttentionInterface

    from bench import gpu_checks_attention as att
    from pitstop.train import doc_attention

    def windowless(module, query, key, value, attention_mask, **kwargs):
        kwargs.pop("sliding_window", None)
        return doc_attention.doc_sdpa_attention(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("planted_windowless", windowless)
    configs = {k: v for k, v in att.window_configs().items() if k in ("mistral", "phi3")}
    rows = att.check_window(torch.device("cpu"), "fp32", kernel="planted_windowless",
                            configs=configs)  # fmt: skip
    assert [r.status for r in rows] == ["FAIL", "FAIL"], [r.detail for r in rows]
    assert all("TOO LARGE" in r.detail for r in rows)


def test_the_gpu_window_batches_reach_the_masked_path() -> None:
    """On a GPU the window check adds a micro-batch past sdpa_docs' call limit; its rows
    must pack (equal widths) and hold more distinct lengths than the limit."""
    from types import SimpleNamespace

    from bench.gpu_checks_attention import window_batches
    from bench.gpu_checks_util import packed_rows
    from pitstop.train import doc_attention

    few, many = window_batches(SimpleNamespace(type="cuda"))
    assert max(max(r) for r in few) > getattr(doc_attention, "BAND_BLOCK", 256)
    assert len({n for r in many for n in r}) > getattr(doc_attention, "MAX_CALLS", 32)
    for rows in (few, many):
        mb, docs = packed_rows(rows)
        assert mb["input_ids"].shape == (len(rows), sum(rows[0]))
        assert [len(d) for d in docs] == [n for r in rows for n in r]


def test_the_packed_rows_run_on_the_cpu() -> None:
    from bench import gpu_selftest as st

    rows = st.check_packed(torch.device("cpu"), "fp32")
    by = {r.check: r.status for r in rows}
    for kernel in ("sdpa_docs", "sdpa", "eager"):
        assert by[f"packed attention: {kernel}"] == "pass"
    assert by["packed attention: flash_attention_2"] == "skip"
    assert "FAIL" not in st.table(rows)


def test_the_recompile_check_runs_on_the_cpu_with_one_graph_for_one_and_two_rows() -> None:
    """The check a lent GPU runs with inductor, here with aot_eager: 1- and 2-row
    micro-batches over ten layouts in one graph (without `mark_rows_dynamic` the first
    one-row micro-batch is a graph of its own, and the check fails)."""
    from bench import gpu_selftest as st

    (row,) = st.run_checks(torch.device("cpu"), "fp32", [st.check_recompiles])
    assert row.status == "pass", row.detail
    assert "1 graphs in all" in row.detail and "0 graph breaks" in row.detail


def test_a_crashing_check_is_a_failed_row_and_the_rest_still_run() -> None:
    from bench import gpu_selftest as st

    def check_boom(dev, precision):
        raise RuntimeError("kaput")

    def check_fine(dev, precision):
        return [st.Row("fine", "pass", "ok")]

    rows = st.run_checks(torch.device("cpu"), "fp32", [check_boom, check_fine])
    assert [r.status for r in rows] == ["FAIL", "pass"] and "kaput" in rows[0].detail
    assert rows[0].check == "boom"


def test_only_picks_checks_by_name_and_refuses_unknown_ones() -> None:
    from bench import gpu_selftest as st

    picked = st.select("window,staging", None)
    assert [st.check_name(fn) for fn in picked] == ["window", "staging"]
    assert "unknown check(s) nope" in st.select("window,nope", None)
    assert "needs --model" in st.select("model", None)
    model = st.model_check("some/dir", None)
    assert st.select(None, model) == [model]  # --model alone: only the model's check
    assert st.check_name(st.select("window", model)[-1]) == "model"
    assert st.main(["--only", "nope"]) == 2
    assert st.main(["--lora-r", "4"]) == 2


def test_the_model_check_runs_the_start_up_check_on_a_model_dir(tiny_model_dir) -> None:
    from bench import gpu_selftest as st

    rows = st.run_checks(torch.device("cpu"), "fp32", [st.model_check(str(tiny_model_dir), None)])
    assert [r.status for r in rows] == ["pass"], rows
    assert "one packed micro-batch" in rows[0].detail


def test_the_matmul_verdict_catches_a_table_row_wrong_for_the_card() -> None:
    from bench.gpu_checks_speed import matmul_row

    assert matmul_row("NVIDIA H100 80GB HBM3", 700e12, 989.4e12, "src").status == "pass"
    wrong = matmul_row("NVIDIA H100 PCIe", 300e12, 989.4e12, "src")  # the SXM row on a PCIe
    assert wrong.status == "FAIL" and "300 TFLOP/s" in wrong.detail and "989" in wrong.detail
    assert matmul_row("NVIDIA H100", 1100e12, 989.4e12, "src").status == "FAIL"  # above peak
    assert matmul_row("Mystery GPU", 100e12, None, "not in the table").status == "skip"


def test_two_rank_results_become_rows() -> None:
    from bench.gpu_checks_multi import _rows

    good = {"grad_rel": 1e-7, "ranks_apart": 0.0, "parameters": 10}
    mem = {"predicted": 100.0, "measured": 80.0, "reserved": 20.0, "actual": 104.0}
    rows = _rows([{"ddp": good, "fsdp": good, "memory": mem}] * 2, True, "")
    assert [r.status for r in rows] == ["pass", "pass", "pass"]
    apart = {**good, "ranks_apart": 1e-3}
    over = {**mem, "actual": 120.0}
    rows = _rows([{"ddp": apart, "fsdp": {"error": "boom"}, "memory": over}, {}], True, "")
    assert [r.status for r in rows] == ["FAIL", "FAIL", "FAIL"]
    assert "boom" in rows[1].detail and "no result" in rows[1].detail


@pytest.fixture()
def fake_sync_debug(monkeypatch):
    """torch.cuda's sync debug mode as a plain value (this CPU build has no CUDA)."""
    mode = [0]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode[0])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: mode.__setitem__(0, m))
    return mode


def test_the_sync_check_fails_a_step_that_syncs_and_passes_one_that_does_not(
    tmp_path, fake_sync_debug
) -> None:
    """The CUDA branch of the sync check, driven on the CPU: a planted sync in the optimizer
    step (raised as torch raises it in "error" mode) is a FAIL naming the step and where."""
    from types import SimpleNamespace

    from bench.gpu_checks_train import quiet_pitstop, small_trainer, sync_row

    cuda = SimpleNamespace(type="cuda")
    with quiet_pitstop():
        clean = small_trainer(tmp_path, torch.device("cpu"))
        row = sync_row(clean, cuda)
        assert row.status == "pass" and "3 steps" in row.detail, row
        assert fake_sync_debug[0] == 0  # put back after every step

        planted = small_trainer(tmp_path, torch.device("cpu"), attention="sdpa")
        real = planted.optimizer_step

        def syncing_step(loss):
            if fake_sync_debug[0] == "error":
                raise RuntimeError("called a synchronizing CUDA operation")
            return real(loss)

        planted.optimizer_step = syncing_step
        row = sync_row(planted, cuda)
    assert row.status == "FAIL" and "step 1 of 3" in row.detail, row
    assert "syncing_step" in row.detail and "synchronizing CUDA operation" in row.detail
    assert fake_sync_debug[0] == 0


def test_where_raised_names_the_frame() -> None:
    from bench.gpu_checks_util import where_raised

    def inner() -> None:
        raise RuntimeError("x")

    try:
        inner()
    except RuntimeError as e:
        assert "in inner" in where_raised(e)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_gpu_check_passes() -> None:
    from bench import gpu_selftest as st

    dev = torch.device("cuda", torch.cuda.current_device())
    rows = st.run_checks(dev, "bf16")
    failed = [r for r in rows if r.status == "FAIL"]
    assert not failed, st.table(rows)


def test_the_lent_gpu_installer_picks_the_newest_wheel_the_machine_can_take(tmp_path) -> None:
    """bench/gpu_wheels: of two releases in the folder, the newest whose requirements the
    installed packages meet; a package already installed is never replaced."""
    import zipfile

    from bench.gpu_wheels import plan

    def wheel(name: str, version: str, *requires: str) -> None:
        path = tmp_path / f"{name}-{version}-py3-none-any.whl"
        meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
        with zipfile.ZipFile(path, "w") as z:
            z.writestr(f"{name}-{version}.dist-info/METADATA", f"Name: {name}\n{meta}")

    wheel("pitstopfake", "2.0", "numpy>=999")  # no numpy that new exists
    wheel("pitstopfake", "1.0", "numpy>=1", "pytest; extra == 'test'")
    wheel("pytest", "0.1")  # installed already: left alone
    chosen, problems = plan(tmp_path, ("pitstopfake", "pytest"))
    assert [w.name for w in chosen] == ["pitstopfake-1.0-py3-none-any.whl"] and problems == []
    (tmp_path / "pitstopfake-1.0-py3-none-any.whl").unlink()
    chosen, problems = plan(tmp_path, ("pitstopfake",))
    assert [w.name for w in chosen] == ["pitstopfake-2.0-py3-none-any.whl"]
    assert "numpy>=999" in problems[0]
