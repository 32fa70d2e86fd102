"""Hostile `doctor --hf-args` files (issue 33, never tried): not JSON, not a mapping, huge
numbers, wrong types, unknown keys.

Wrong types and absurd numbers were read as findings ("1000000000000000019884624838656
loader workers on 2 CPU cores"); they are refused with every field named. Real
`TrainingArguments().to_dict()` / `SFTConfig().to_dict()` output still reads.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest

from pitstop.advise.hf_args import declared_problems, load_hf_args
from pitstop.cli import main
from pitstop.core.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("not json {", "not valid JSON"),
        ("[1, 2, 3]", "must be a mapping of field: value"),
        ('"a string"', "must be a mapping of field: value"),
        ('{"per_device_train_batch_size": "eight"}', "per_device_train_batch_size is 'eight'"),
        ('{"gradient_accumulation_steps": -4}', "gradient_accumulation_steps is -4"),
        ('{"dataloader_num_workers": 1e30}', "it must be an integer from 0 to 1,024"),
        ('{"learning_rate": 1e400}', "learning_rate is inf; give a finite number"),
        ('{"learning_rate": NaN}', "learning_rate is nan"),
        ('{"bf16": "yes"}', "bf16 is 'yes'; it must be true or false"),
        ('{"logging_steps": 0}', "logging_steps is 0"),
        ('{"save_strategy": "sometimes"}', "one of 'no', 'steps', 'epoch', 'best'"),
        ('{"max_length": 2.5}', "max_length is 2.5"),
        ('{"optim": 7}', "optim is 7; it must be a name"),
    ],
)
def test_a_hostile_file_is_refused_naming_the_field(tmp_path: Path, text: str, needle: str) -> None:
    p = tmp_path / "args.json"
    p.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_hf_args(p)
    assert needle in str(e.value)


def test_every_problem_is_listed_at_once_through_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = tmp_path / "args.json"
    p.write_text(json.dumps({"per_device_train_batch_size": "eight", "bf16": "yes",
                             "dataloader_num_workers": -1}), encoding="utf-8")  # fmt: skip
    assert main(["doctor", "--hf-args", str(p), "--no-compile-check"]) == 2
    err = capsys.readouterr().err
    assert "3 field(s)" in err and "Traceback" not in err
    for field in ("per_device_train_batch_size", "bf16", "dataloader_num_workers"):
        assert field in err


def test_unknown_keys_are_named_not_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = tmp_path / "args.json"
    p.write_text(json.dumps({"no_such_field": 3, "dataloader_num_workers": 0}), encoding="utf-8")
    assert main(["doctor", "--hf-args", str(p), "--no-compile-check"]) == 0
    assert "unknown fields (ignored): no_such_field" in capsys.readouterr().out


def test_real_to_dict_output_reads() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import TrainingArguments

        args = TrainingArguments("/tmp/pitstop-unused", logging_steps=0.1, save_strategy="steps",
                                 save_steps=100, dataloader_num_workers=4)  # fmt: skip
    assert declared_problems(json.loads(json.dumps(args.to_dict()))) == []


def test_a_directory_or_a_missing_path_is_called_what_it_is(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"--hf-args {tmp_path} is a directory; give")):
        load_hf_args(tmp_path)
    with pytest.raises(ConfigError, match=r"no\.json does not exist; give a JSON"):
        load_hf_args(tmp_path / "no.json")
