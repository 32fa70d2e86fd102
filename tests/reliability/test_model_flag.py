"""`--model` of the commands that only read a model's shape (issue 33 item 7).

`doctor --model DOES_NOT_EXIST` was ignored silently: the model rules stayed quiet and
nothing said why. A cached Hub id resolves to its snapshot, offline.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _train_util import fake_hub_cache

from pitstop.cli import main
from pitstop.core.errors import ConfigError
from pitstop.core.hub import model_dir


def test_model_dir_names_what_is_missing(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError, match="--model DOES_NOT_EXIST: no such model directory"):
        model_dir("DOES_NOT_EXIST")
    with pytest.raises(ConfigError, match="not in the local Hugging Face cache"):
        model_dir("org/missing")
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        model_dir(str(tmp_path))
    snap = fake_hub_cache(tmp_path / "hub", "org/tiny", tiny_model_dir)
    assert Path(model_dir("org/tiny")) == snap.resolve()
    assert model_dir(str(tiny_model_dir)) == str(tiny_model_dir)


def test_doctor_refuses_a_model_that_is_not_there(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--model", "DOES_NOT_EXIST", "--no-compile-check"]) == 2
    err = capsys.readouterr().err
    assert "--model DOES_NOT_EXIST: no such model directory" in err and "Traceback" not in err


def test_doctor_reads_a_cached_hub_id(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    import importlib

    doctor_mod = importlib.import_module("pitstop.advise.doctor")

    snap = fake_hub_cache(tmp_path / "hub", "org/tiny", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    read = []
    facts = doctor_mod.model_facts
    monkeypatch.setattr(doctor_mod, "model_facts", lambda d: read.append(d) or facts(d))
    assert main(["doctor", "--model", "org/tiny", "--no-compile-check", "--json"]) == 0
    assert [Path(d) for d in read] == [snap.resolve()] and facts(read[0]) is not None


def test_estimate_resolves_a_cached_hub_id_and_names_a_missing_one(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_hub_cache(tmp_path / "hub", "org/tiny", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert main(["estimate", "--model", "org/tiny", "--tokens", "1e6", "--gpu", "H100"]) == 0
    assert "Time" in capsys.readouterr().out
    assert main(["estimate", "--model", "org/missing", "--tokens", "1e6", "--gpu", "H100"]) == 2
    err = capsys.readouterr().err
    assert "--model org/missing: no such model directory" in err and "hf download" in err
