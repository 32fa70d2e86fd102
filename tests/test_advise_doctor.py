"""`pitstop doctor`: the environment probe on CPU, the command's JSON shape, inputs and errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from pitstop.advise.environment import check_compile, environment, read_throughput
from pitstop.commands.doctor import register
from pitstop.core.errors import ConfigError
from pitstop.data.stats import compute_stats
from pitstop.data.store import StoreWriter
from pitstop.measure.schema import make_profile

FINDING_KEYS = {"id", "severity", "title", "evidence", "effect", "basis", "fix"}


def run_doctor(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    parser = argparse.ArgumentParser(prog="pitstop")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["doctor", "--no-compile-check", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    """A token store whose manifest carries length statistics (as `pitstop prepare` writes)."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.0, 0.6, 500).astype(np.int64), 8, 1024)
    dest = tmp_path / "store"
    w = StoreWriter(dest, vocab_size=4096)
    toks = rng.integers(0, 4096, int(lengths.sum()))
    w.append(toks, np.ones(len(toks), dtype=np.uint8), lengths, np.arange(len(lengths)))
    stats = compute_stats(lengths, lengths, max_seq_len=4096, counts={"documents": len(lengths)})
    return w.finish({"max_seq_len": 4096, "stats": stats})


def test_environment_keys_on_cpu(tmp_path: Path) -> None:
    data = tmp_path / "d.bin"
    data.write_bytes(b"x" * 3_000_000)
    env = environment(data=data, loader_workers=8, compile_check=False)
    for key in ("python", "torch", "cuda", "driver", "transformers", "device", "bf16",
                "flash_attn", "tf32", "workers", "compile", "disk"):  # fmt: skip
        assert key in env, key
    assert env["device"]["type"] in ("cpu", "cuda")
    assert env["workers"]["loader_workers"] == 8 and env["workers"]["cpu_cores"] >= 1
    assert env["compile"]["checked"] is False
    assert env["disk"]["bytes_read"] == 3_000_000 and env["disk"]["bytes_per_second"] > 0
    json.dumps(env)  # serialisable


def test_read_throughput_is_bounded(tmp_path: Path) -> None:
    f = tmp_path / "big"
    f.write_bytes(b"y" * 2_000_000)
    r = read_throughput(tmp_path, limit_bytes=1_000_000)  # a directory: its largest file
    assert r["bytes_read"] == 1_000_000 and r["path"] == str(f)


def test_compile_check_uses_its_cache(tmp_path: Path) -> None:
    import platform

    import torch

    key = {"torch": torch.__version__, "python": platform.python_version(), "device": "cpu"}
    from pitstop.core.cache_layout import COMPILE_CHECK, keyed_cache_path

    keyed_cache_path(tmp_path, COMPILE_CHECK, key).write_text(
        json.dumps({"key": key, "result": {"checked": True, "works": True, "reason": "cached ok"}})
    )
    r = check_compile("cpu", tmp_path)
    assert r["works"] and r["cached"]


def test_doctor_json_hf_args_with_store(tmp_path: Path, store: Path, capsys) -> None:
    args = tmp_path / "args.json"
    args.write_text(json.dumps({
        "per_device_train_batch_size": 8, "packing": False, "max_length": 4096,
        "dataloader_num_workers": 0, "learning_rate": 2e-5, "lerning_rate": 1,
    }))  # fmt: skip
    out = json.loads(run_doctor(["--hf-args", str(args), "--data", str(store), "--json",
                                 "--cache-dir", str(tmp_path / "c")], capsys))  # fmt: skip
    assert {"environment", "findings", "verdict", "setup", "fields"} <= set(out)
    assert out["setup"]["source"] == "hf" and out["setup"]["hf_class"] == "SFTConfig"
    ids = [f["id"] for f in out["findings"]]
    assert "padding-waste" in ids and "max-len-above-p99" in ids and "loader-main-process" in ids
    for f in out["findings"]:
        assert set(f) >= FINDING_KEYS
        assert f["severity"] in ("high", "medium", "low")
    assert out["fields"]["unknown"] == ["lerning_rate (did you mean learning_rate?)"]
    assert "learning_rate" in out["fields"]["not_checked"]
    assert out["environment"]["disk"]["bytes_read"] > 0


def test_doctor_table_pitstop_config_and_profile(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"batching": "pad", "loader_workers": 0, "save_steps": 10}))
    per = [{"data_wait": 0.03, "forward": 0.02, "backward": 0.04, "checkpoint": 0.0}] * 9
    per.append({"data_wait": 0.03, "forward": 0.02, "backward": 0.04, "checkpoint": 0.5})
    prof = make_profile(per, [sum(p.values()) for p in per], warmup=1, source="pitstop",
                        events={"checkpoints": 1})  # fmt: skip
    (tmp_path / "p.json").write_text(json.dumps(prof))
    out = run_doctor(["--config", str(cfg), "--profile", str(tmp_path / "p.json")], capsys)
    assert "verdict: checkpoint-bound (severe)" in out and "also input-bound (severe)" in out
    assert "[input-bound]" in out and "--loader-workers" in out
    assert "[checkpoint-overhead]" in out and "--save-steps" in out
    assert "[packing-off]" in out


def test_doctor_profile_alone_uses_its_config(tmp_path: Path, capsys) -> None:
    per = [{"data_wait": 0.001, "forward": 0.03, "backward": 0.06, "optimizer": 0.01}] * 5
    prof = make_profile(per, [0.101] * 5, warmup=1, source="hf",
                        config={"dataloader_num_workers": 0}, device={"type": "cpu", "name": "cpu", "cpu_count": 4})  # fmt: skip
    (tmp_path / "p.json").write_text(json.dumps(prof))
    out = json.loads(run_doctor(["--profile", str(tmp_path / "p.json"), "--json"], capsys))
    assert out["setup"]["source"] == "hf"
    assert out["verdict"]["kind"] == "compute-bound"
    assert "loader-main-process" in [f["id"] for f in out["findings"]]


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("a.json", "{bad", "not valid JSON"),
        ("a.yaml", "a: [1,", "not valid YAML"),
        ("a.json", "[1, 2]", "must be a mapping"),
    ],
)
def test_bad_hf_args(tmp_path: Path, capsys, name: str, text: str, match: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=match):
        run_doctor(["--hf-args", str(tmp_path / name)], capsys)


def test_dataset_file_needs_a_model(tmp_path: Path, capsys) -> None:
    (tmp_path / "d.jsonl").write_text('{"text": "hello"}\n')
    with pytest.raises(ConfigError, match="give --model DIR"):
        run_doctor(["--data", str(tmp_path / "d.jsonl")], capsys)


def test_bad_pitstop_config_reports_problems(tmp_path: Path, capsys) -> None:
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({"batchng": "pack"}))
    with pytest.raises(ConfigError, match="did you mean 'batching'"):
        run_doctor(["--config", str(tmp_path / "r.yaml")], capsys)
