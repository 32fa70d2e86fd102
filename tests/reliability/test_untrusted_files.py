"""Untrusted files never run code: weights come from safetensors, other tensors load with
weights_only=True, and model-directory code runs only with --trust-remote-code.

Each planted file would create a marker file if it were executed (a pickle whose
__reduce__ calls pathlib.Path.touch; a modeling_x.py that touches at import). The
security guarantee is that the marker never appears. A separate assertion wants a
clear error naming the file rather than a traceback (`Uncaught` when an exception
escapes the CLI).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _rel import env, train_cmd

pytestmark = pytest.mark.slow


class Uncaught(AssertionError):
    """The CLI let an exception escape: the user would see a traceback."""


class _Plant:
    """Unpickling this creates `path` (pathlib, no os.system): proof that code ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def _cli(args: list[str]) -> tuple[int | None, BaseException | None]:
    from pitstop.cli import main

    try:
        return main(args), None
    except Exception as e:  # in the real CLI this would be a traceback
        return None, e


def _reseal(ck: Path) -> None:
    """Rewrite COMPLETE.json for the planted files, so discovery accepts the directory and
    the loader, not the size check, is what has to refuse them."""
    marker = json.loads((ck / "COMPLETE.json").read_text())
    marker["files"] = {
        str(p.relative_to(ck)): p.stat().st_size
        for p in sorted(ck.rglob("*"))
        if p.is_file() and p.name != "COMPLETE.json"
    }
    (ck / "COMPLETE.json").write_text(json.dumps(marker))


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, tiny_model_dir, rel_store) -> Path:
    """A run stopped after step 2 (PITSTOP_TEST_STOP_AT_STEP acts like SIGTERM)."""
    out = tmp_path_factory.mktemp("stopped") / "out"
    os.environ["PITSTOP_TEST_STOP_AT_STEP"] = "2"
    try:
        rc, exc = _cli(train_cmd(tiny_model_dir, rel_store, out, steps=4)[3:])
    finally:
        del os.environ["PITSTOP_TEST_STOP_AT_STEP"]
    assert exc is None and rc == 143
    return out


PLANTS = {
    # the optimizer state: torch.load(weights_only=True) must refuse the pickle
    "optimizer.pt": ("optimizer.pt", None),
    # a non-JSON loader state is read with torch.load too
    "loader_state.pt": ("loader_state.pt", "loader_state.json"),
    # a pytorch_model.bin instead of safetensors: weights load only from safetensors
    "pytorch_model.bin": ("pytorch_model.bin", "model.safetensors"),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_pickle_in_a_checkpoint_never_runs(plant, stopped_run, tiny_model_dir, rel_store, tmp_path, capsys):  # fmt: skip
    name, replaces = PLANTS[plant]
    out = tmp_path / "out"
    shutil.copytree(stopped_run, out)
    ck = out / "checkpoints" / "step-2"
    marker = tmp_path / "PWNED"
    torch.save(_Plant(marker), ck / name)
    if replaces:
        (ck / replaces).unlink()
    _reseal(ck)
    rc, exc = _cli(train_cmd(tiny_model_dir, rel_store, out, "--resume", steps=4)[3:])
    err = capsys.readouterr().err
    assert not marker.exists(), "unpickling ran code from a checkpoint"
    assert exc is not None or rc not in (None, 0), "a planted checkpoint was used"
    if exc is not None:
        raise Uncaught(f"{type(exc).__name__}: {str(exc)[:300]}")
    assert str(ck) in err and "Traceback" not in err


def _model_copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("pitstop_tiny.json"))
    return dest


def test_pytorch_model_bin_beside_safetensors_is_ignored(
    tiny_model_dir, rel_store, tmp_path, capsys
):
    model = _model_copy(tiny_model_dir, tmp_path / "model")
    marker = tmp_path / "PWNED"
    torch.save(_Plant(marker), model / "pytorch_model.bin")
    rc, exc = _cli(train_cmd(model, rel_store, tmp_path / "out", steps=1)[3:])
    capsys.readouterr()
    assert exc is None and rc == 0
    assert not marker.exists()


def test_pytorch_model_bin_instead_of_safetensors_is_refused(tiny_model_dir, rel_store, tmp_path, capsys):  # fmt: skip
    model = _model_copy(tiny_model_dir, tmp_path / "model")
    (model / "model.safetensors").unlink()
    marker = tmp_path / "PWNED"
    torch.save(_Plant(marker), model / "pytorch_model.bin")
    out = tmp_path / "out"
    rc, exc = _cli(train_cmd(model, rel_store, out, steps=1)[3:])
    err = capsys.readouterr().err
    assert not marker.exists(), "a pickled model file ran code"
    assert rc != 0 and not out.exists()
    if exc is not None:
        raise Uncaught(f"{type(exc).__name__}: {str(exc)[:300]}")
    assert "safetensors" in err and "Traceback" not in err


CODE = """import pathlib
pathlib.Path({marker!r}).touch()
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
class XConfig(LlamaConfig):
    model_type = "xcustom"
class X(LlamaForCausalLM):
    config_class = XConfig
class XTok(PreTrainedTokenizerFast):
    pass
"""


def _remote_code_model(src: Path, dest: Path, marker: Path, model_type: str | None) -> Path:
    """A model dir whose config/tokenizer point (auto_map) at code that touches `marker`."""
    d = _model_copy(src, dest)
    for f in ("modeling_x.py", "configuration_x.py", "tokenization_x.py"):
        (d / f).write_text(CODE.format(marker=str(marker)))
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {
        "AutoConfig": "configuration_x.XConfig",
        "AutoModelForCausalLM": "modeling_x.X",
    }
    if model_type:
        cfg["model_type"] = model_type
    (d / "config.json").write_text(json.dumps(cfg))
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    tcfg["auto_map"] = {"AutoTokenizer": [None, "tokenization_x.XTok"]}
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg))
    return d


def test_planted_code_would_run_with_trust_remote_code(tiny_model_dir, tmp_path):
    """The control: the planted module really executes when trust is given (in a child
    process with its own HF_MODULES_CACHE), so the tests below prove something."""
    marker = tmp_path / "PWNED"
    d = _remote_code_model(tiny_model_dir, tmp_path / "m", marker, "xcustom")
    code = f"from transformers import AutoConfig; AutoConfig.from_pretrained({str(d)!r}, trust_remote_code=True)"
    r = subprocess.run([sys.executable, "-c", code], env=env(HF_MODULES_CACHE=str(tmp_path / "mods")),
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert marker.exists()


def test_remote_code_is_ignored_for_a_known_architecture(
    tiny_model_dir, rel_store, tmp_path, capsys
):
    marker = tmp_path / "PWNED"
    d = _remote_code_model(tiny_model_dir, tmp_path / "m", marker, None)
    rc, exc = _cli(train_cmd(d, rel_store, tmp_path / "out", steps=1)[3:])
    assert exc is None and rc == 0
    data = tmp_path / "t.jsonl"
    data.write_text('{"text": "hello"}\n')
    rc, exc = _cli(["prepare", "--model", str(d), "--data", str(data), "--workers", "1",
                    "--cache-dir", str(tmp_path / "cache"), "--json"])  # fmt: skip
    capsys.readouterr()
    assert exc is None and rc == 0
    assert not marker.exists(), "model-directory code ran without --trust-remote-code"


def test_remote_code_only_architecture_is_refused(tiny_model_dir, rel_store, tmp_path, capsys):
    marker = tmp_path / "PWNED"
    d = _remote_code_model(tiny_model_dir, tmp_path / "m", marker, "xcustom")
    out = tmp_path / "out"
    rc, exc = _cli(train_cmd(d, rel_store, out, steps=1)[3:])
    err = capsys.readouterr().err
    assert not marker.exists(), "model-directory code ran without --trust-remote-code"
    assert rc != 0 and not out.exists()
    if exc is not None:
        raise Uncaught(f"{type(exc).__name__}: {str(exc)[:300]}")
    assert "--trust-remote-code" in err and "Traceback" not in err
