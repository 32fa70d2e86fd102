"""`pitstop doctor` audits for a target (GPU, processes, LoRA, transformers release) from a CPU box.

`doctor --hf-args ARGS.json --gpu H100 --lora-r 16 --transformers-version 4.41.2` on this
CPU machine must judge the GPU rules for the H100 (fused optimizer, compile, unneeded
gradient checkpointing where the memory estimate fits), the gradient-accumulation loss
bug for the pinned 4.41.2 (the installed transformers is newer), and say what it
audited for. Without the target flags the same config gets none of the GPU findings.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pitstop.advise.doctor import doctor
from pitstop.advise.target import make_target
from pitstop.commands.doctor import register
from pitstop.core.errors import ConfigError
from pitstop.probe import DeviceInfo

ARGS = {
    "output_dir": "out", "per_device_train_batch_size": 2, "gradient_accumulation_steps": 8,
    "gradient_checkpointing": True, "bf16": True, "optim": "adamw_torch",
    "learning_rate": 2e-4, "warmup_ratio": 0.03, "logging_steps": 10,
}  # fmt: skip
CPU = DeviceInfo(type="cpu", name="AMD EPYC", cpu_count=2)
TARGET_FLAGS = ["--gpu", "H100", "--lora-r", "16", "--transformers-version", "4.41.2"]


def run_doctor(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[dict, str]:
    parser = argparse.ArgumentParser(prog="pitstop")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["doctor", "--no-compile-check", *argv])
    assert args.func(args) == 0
    return {}, capsys.readouterr().out


@pytest.fixture(scope="module")
def target_report(tiny_model_dir: Path, tmp_path_factory) -> tuple[dict, Path]:
    d = tmp_path_factory.mktemp("target")
    args = d / "args.json"
    args.write_text(json.dumps(ARGS))
    parser = argparse.ArgumentParser(prog="pitstop")
    register(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(
        ["doctor", "--no-compile-check", "--hf-args", str(args), *TARGET_FLAGS,
         "--model", str(tiny_model_dir), "--json", "--output", str(d / "run")]
    )  # fmt: skip
    assert ns.func(ns) == 0
    return json.loads((d / "run" / "findings.json").read_text()), d


def _ids(report: dict) -> dict[str, dict]:
    return {f["id"]: f for f in report["findings"]}


def test_says_what_it_audited_for(target_report: tuple[dict, Path]) -> None:
    report, _ = target_report
    assert report["audited_for"].startswith("audited for 1 × H100")
    assert "LoRA r=16" in report["audited_for"] and "transformers 4.41.2" in report["audited_for"]
    assert "this machine:" in report["audited_for"]
    assert report["setup"]["device"]["type"] == "cuda"
    assert report["target"]["lora_r"] == 16


def test_fused_optimizer_for_the_target_gpu(target_report: tuple[dict, Path]) -> None:
    f = _ids(target_report[0])["optimizer-not-fused"]
    assert f["fix"] == 'optim="adamw_torch_fused"'
    assert f["evidence"]["trained"] == "LoRA adapters only"


def test_compile_for_the_target_gpu(target_report: tuple[dict, Path]) -> None:
    assert _ids(target_report[0])["compile-off"]["fix"] == "torch_compile=True"


def test_ga_loss_bug_for_the_pinned_transformers(target_report: tuple[dict, Path]) -> None:
    f = _ids(target_report[0])["ga-loss-bug"]
    assert f["evidence"]["transformers"] == "4.41.2"
    assert f["evidence"]["gradient_accumulation_steps"] == 8


def test_checkpointing_unneeded_when_lora_fits(target_report: tuple[dict, Path]) -> None:
    f = _ids(target_report[0])["gradient-checkpointing-unneeded"]
    ev = f["evidence"]
    assert ev["estimated_peak_without_bytes"] < 0.9 * ev["device_memory_bytes"]
    assert "LoRA" in ev["how"]
    # The target's transformers 4.x names the field gradient_checkpointing.
    assert f["fix"] == "gradient_checkpointing=False"


def test_table_prints_the_target(target_report: tuple[dict, Path], tiny_model_dir, capsys) -> None:
    _, d = target_report
    _, out = run_doctor(
        ["--hf-args", str(d / "args.json"), *TARGET_FLAGS, "--model", str(tiny_model_dir)], capsys
    )
    assert "audited for 1 × H100" in out
    assert "fields read as TrainingArguments" in out
    assert "unknown fields" not in out  # warmup_ratio is a field of older transformers


def test_without_target_no_gpu_findings(tiny_model_dir: Path) -> None:
    r = doctor(
        hf_args=ARGS, model=tiny_model_dir, device=CPU, compile_check=False, disk_check=False
    )
    ids = set(_ids(r))
    assert not ids & {"optimizer-not-fused", "compile-off", "flash-attn-missing"}
    assert r["audited_for"] is None


def test_full_fine_tune_of_a_big_model_does_not_fit(tiny_model_dir: Path) -> None:
    """The same memory rule without LoRA: 16 B/param of a model bigger than the card stays quiet."""
    target = make_target(CPU, gpu="T4")
    r = doctor(hf_args=ARGS, model=tiny_model_dir, device=CPU, compile_check=False,
               disk_check=False, target=target)  # fmt: skip
    # The tiny model fits anywhere: the rule fires for a full fine-tune on a T4 too ...
    assert "gradient-checkpointing-unneeded" in _ids(r)
    big = {**ARGS, "per_device_train_batch_size": 4096}  # ... but not with huge micro-batches
    r = doctor(hf_args=big, model=tiny_model_dir, device=CPU, compile_check=False,
               disk_check=False, target=target)  # fmt: skip
    assert "gradient-checkpointing-unneeded" not in _ids(r)


def test_worker_fix_does_not_use_this_machines_cores(tiny_model_dir: Path) -> None:
    target = make_target(CPU, gpu="H100")
    r = doctor(hf_args=ARGS, device=CPU, compile_check=False, disk_check=False, target=target)
    assert _ids(r)["loader-main-process"]["fix"] == "dataloader_num_workers=4"
    target = make_target(CPU, gpu="H100", cpus=3)
    r = doctor(hf_args=ARGS, device=CPU, compile_check=False, disk_check=False, target=target)
    assert _ids(r)["loader-main-process"]["fix"] == "dataloader_num_workers=2"


def test_nproc_changes_the_effective_batch() -> None:
    target = make_target(CPU, gpu="H100", nproc=2)
    r = doctor(hf_args=ARGS, baseline=ARGS, device=CPU, compile_check=False, disk_check=False,
               target=target)  # fmt: skip
    # Both files are read for the same target, so the baseline's batch is the same.
    assert "effective-batch-changed" not in _ids(r)
    assert "2 × H100" in r["audited_for"]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"gpu": "H1000"}, "is not a GPU pitstop knows"),
        ({"nproc": 0}, "--nproc must be 1 or more"),
        ({"load_in_4bit": True}, "add --lora-r"),
        ({"transformers_version": "latest"}, "must look like 4.41.2"),
    ],
)
def test_bad_target_flags(kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_target(CPU, **kw)


def test_effective_batch_in_rows_for_dynamically_padded_batches() -> None:
    """SFTConfig without packing pads each batch to its longest row: rows, not rows x max_length."""
    before = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 8, "max_length": 512}
    after = {**before, "gradient_accumulation_steps": 4}
    r = doctor(hf_args=after, baseline=before, device=CPU, compile_check=False, disk_check=False)
    f = _ids(r)["effective-batch-changed"]
    assert f["evidence"]["unit"] == "rows" and (
        f["evidence"]["baseline"],
        f["evidence"]["this"],
    ) == (16, 8)
    assert "16 -> 8 rows" in f["title"]
