"""Several processes on CPU (gloo): DDP and FSDP2 give the single-process run's losses.

The loader deals each step's rows to the ranks and every rank divides its summed CE
by the step's target count over all ranks; undoing DDP's/FSDP's gradient averaging
(x world size) must then give exactly the single-process gradient. Here: 4 rows per
step, one process with 2-row micro-batches vs two processes with 1-row micro-batches
(so each rank also accumulates two micro-batches: no_sync / gradient sync off).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _train_util import assert_same_weights_across_ranks, free_port, rank_env
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.long]

STEPS = 4


# The shared `store` fixture (tests/conftest.py) builds a 12-chapter store here.
STORE_DOCS = 12


@pytest.fixture(scope="module")
def reference(tiny_model_dir, store, tmp_path_factory):
    """The single-process run: 4 rows of 64 per step, micro-batches of 2 rows."""
    from _train_util import train_config

    from pitstop.train import run

    out = tmp_path_factory.mktemp("ref") / "out"
    run(train_config(tiny_model_dir, store, out, max_steps=STEPS, micro_batch_size=2))
    return out


def _args(model: Path, store: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(model), "--data", str(store), "--output", str(out),
            "--max-seq-len", "64", "--tokens-per-step", "256", "--micro-batch-size", "1",
            "--batching", "pack", "--max-steps", str(STEPS), "--log-steps", "2", "--lr", "1e-3",
            "--report-to", "none", "--compile", "off", "--save-steps", "2",
            "--cache-dir", str(out.parent / "cache"), *extra]  # fmt: skip


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _same_run(ref: Path, out: Path, weights: str = "model.safetensors") -> None:
    a, b = _metrics(ref), _metrics(out)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-5), (x["step"], x["loss"], y["loss"])
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
        for k in ("trained_tokens", "seen_tokens", "step_trained_tokens"):
            assert y[k] == x[k], k  # counted over both ranks
    assert_same_weights_across_ranks(ref / "final" / weights, out / "final" / weights)


def test_nproc_2_ddp_matches_one_process_and_resumes(tiny_model_dir, store, reference, tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "pitstop", *_args(tiny_model_dir, store, out), "--nproc", "2"]
    # Stop after step 2 (as SIGTERM would), then resume with two processes again.
    tmp = tmp_path / "tmpdir"  # the launch's temporary files: none may be left behind
    tmp.mkdir()
    cut = subprocess.run(cmd, env=rank_env(PITSTOP_TEST_STOP_AT_STEP="2", TMPDIR=str(tmp)),
                         capture_output=True, text=True, timeout=240)  # fmt: skip
    assert cut.returncode != 0 and "launching 2 processes" in cut.stderr, cut.stderr
    assert "--nproc-per-node 2" in cut.stderr
    left = [
        p.name for p in tmp.iterdir() if p.name.startswith(("torchelastic_", "pitstop-launch-"))
    ]
    assert left == [], left  # torchrun's own log directory went with the launch's
    assert (out / "checkpoints" / "step-2" / "COMPLETE.json").is_file()
    done = subprocess.run([*cmd, "--resume"], env=rank_env(), capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["world_size"] == 2 and s["choices"]["strategy"]["value"] == "ddp"
    assert s["resumed_from"].endswith("step-2")
    _same_run(reference, out)
    assert done.stderr.count("pitstop train: ") == 1  # one banner: rank 1 stays quiet


def test_torchrun_fsdp2_on_gloo_matches_one_process(tiny_model_dir, store, reference, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "fsdp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "pitstop",
           *_args(tiny_model_dir, store, out), "--strategy", "fsdp"]  # fmt: skip
    done = subprocess.run(cmd, env=rank_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["choices"]["strategy"]["value"] == "fsdp"
    _same_run(reference, out)
    AutoModelForCausalLM.from_pretrained(out / "final")  # the gathered full state loads
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]


@pytest.fixture(scope="module")
def lora_reference(tiny_model_dir, store, tmp_path_factory):
    """The single-process LoRA run (r=4), with the checkpoint at step 2 to compare against."""
    from _train_util import train_config

    from pitstop.train import run

    out = tmp_path_factory.mktemp("lora-ref") / "out"
    run(train_config(tiny_model_dir, store, out, max_steps=STEPS, micro_batch_size=2,
                     lora_r=4, save_steps=2))  # fmt: skip
    return out


def test_torchrun_fsdp2_lora_matches_one_process_and_resumes(
    tiny_model_dir, store, lora_reference, tmp_path
):
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "fsdp-lora"

    def torchrun(*extra: str, **env: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), "-m", "pitstop",
               *_args(tiny_model_dir, store, out), "--strategy", "fsdp", "--lora-r", "4",
               *extra]  # fmt: skip
        return subprocess.run(cmd, env=rank_env(**env), capture_output=True, text=True, timeout=240)

    cut = torchrun(PITSTOP_TEST_STOP_AT_STEP="2")  # stops after step 2, as SIGTERM would
    assert cut.returncode != 0 and "stopped" in cut.stderr, cut.stderr
    step2, ref2 = out / "checkpoints" / "step-2", lora_reference / "checkpoints" / "step-2"
    assert (step2 / "COMPLETE.json").is_file()
    # Only what a one-process LoRA checkpoint holds: the adapter (no base weights) and the
    # adapter's optimizer state.
    assert sorted(p.name for p in step2.iterdir()) == sorted(p.name for p in ref2.iterdir())
    adapter = load_file(step2 / "adapter_model.safetensors")
    assert sorted(adapter) == sorted(load_file(ref2 / "adapter_model.safetensors"))
    optim = torch.load(step2 / "optimizer.pt", weights_only=True)["optimizer"]
    assert len(optim["state"]) == len(adapter)
    assert all(".lora_" in name for name in optim["state"])

    done = torchrun("--resume")
    assert done.returncode == 0, done.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["choices"]["strategy"]["value"] == "fsdp" and "lora" in s["choices"]
    assert s["resumed_from"].endswith("step-2")
    _same_run(lora_reference, out, weights="adapter_model.safetensors")
    # final/ is the PEFT adapter directory the one-process run writes, and peft loads it.
    assert sorted(p.name for p in (out / "final").iterdir()) == sorted(
        p.name for p in (lora_reference / "final").iterdir()
    )
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = peft.PeftModel.from_pretrained(base, out / "final")
    loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(loaded) == len(adapter)


def test_fsdp2_lora_resumes_a_one_process_checkpoint(
    tiny_model_dir, store, lora_reference, tmp_path
):
    """`--resume` with another process count and strategy: the one-process run's step-2
    checkpoint (optimizer state keyed by position) continued by 2 FSDP2 processes."""
    import shutil

    out = tmp_path / "from-one"
    shutil.copytree(lora_reference, out)
    for later in (out / "checkpoints" / "step-4", out / "final"):
        shutil.rmtree(later)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "pitstop",
           *_args(tiny_model_dir, store, out), "--strategy", "fsdp", "--lora-r", "4",
           "--resume"]  # fmt: skip
    done = subprocess.run(cmd, env=rank_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "summary.json").read_text())["resumed_from"].endswith("step-2")
    _same_run(lora_reference, out, weights="adapter_model.safetensors")


def test_launch_argv_is_a_list_without_a_shell(tmp_path):
    from pitstop.train.distributed import launch_argv

    argv = launch_argv(tmp_path / "run.yaml", 3)
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert argv[argv.index("--nproc-per-node") + 1] == "3"
    assert argv[-4:] == ["pitstop", "train", "--config", str(tmp_path / "run.yaml")]
    assert Path(argv[argv.index("--log-dir") + 1]).parent == tmp_path  # removed with it
