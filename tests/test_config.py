"""The typed run configuration: YAML and flags fill one RunConfig; every problem is reported at once."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pitstop.cli import main
from pitstop.core.config import FIELDS, RunConfig, build_config, coerce, load_yaml
from pitstop.core.errors import ConfigError

BASE = {"model": "m", "data": ["d.jsonl"], "output": "out"}


def test_yaml_and_flags_merge_flags_win() -> None:
    cfg = build_config({**BASE, "max_seq_len": 512, "lr": 1e-3}, {"max_seq_len": "2048"})
    assert cfg.max_seq_len == 2048
    assert cfg.lr == 1e-3
    assert isinstance(cfg, RunConfig)


def test_every_problem_reported_at_once() -> None:
    with pytest.raises(ConfigError) as ei:
        build_config(
            {**BASE, "max_seqlen": 5, "batching": "pak", "lr": "fast"},
            {"epochs": "2", "max_steps": "3"},
        )
    msg = str(ei.value)
    assert ei.value.exit_code == 2
    assert len(ei.value.problems) == 4, ei.value.problems
    assert "did you mean 'max_seq_len'" in msg
    assert "did you mean 'pack'" in msg
    assert "lr must be a number" in msg
    assert "--epochs or --max-steps, not both" in msg


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        (
            {"batching": "pack", "max_seq_len": 100, "tokens_per_step": 150},
            "whole number of packed rows",
        ),
        ({"micro_batch_size": 2, "tokens_per_micro_batch": 4096}, "not both"),
        ({"tokens_per_step": 4096, "grad_accum": 4}, "not both"),
        ({"eval_steps": 10}, "config: eval_steps needs --eval-data"),  # said of the file
        ({"resume": True, "overwrite": True}, "--resume or --overwrite"),
        ({"lora_alpha": 16.0}, "without --lora-r"),
        ({"load_in_4bit": True}, "add --lora-r"),
        ({"report_to": ["tensorbored"]}, "choose from tensorboard"),
        ({"max_seq_len": 4}, "at least 8"),
        ({"micro_batch_size": 0}, "must be positive"),
    ],
)
def test_impossible_combinations(values: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        build_config({**BASE, **values})


def test_required_inputs_per_command() -> None:
    with pytest.raises(ConfigError) as ei:
        build_config({}, command="train")
    text = str(ei.value)
    assert "--data" in text and "--model" in text and "--output" in text
    with pytest.raises(ConfigError, match="--tokenizer"):
        build_config({"data": ["x"]}, command="prepare")


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("max_seq_len", "1_024", 1024),
        ("max_seq_len", 2048.0, 2048),
        ("lr", "3e-4", 3e-4),
        ("train_on_prompt", "yes", True),
        ("train_on_prompt", "off", False),
        ("report_to", "tensorboard,wandb", ["tensorboard", "wandb"]),
        ("micro_batch_size", None, None),
    ],
)
def test_coercion(name: str, raw: object, expected: object) -> None:
    assert coerce(name, raw, from_string=isinstance(raw, str)) == expected


@pytest.mark.parametrize(
    ("name", "raw"), [("max_seq_len", "1.5"), ("max_seq_len", True), ("lr", [1]), ("seed", None)]
)
def test_coercion_rejects(name: str, raw: object) -> None:
    with pytest.raises(ValueError):
        coerce(name, raw)


def test_config_round_trips_through_yaml(tmp_path: Path) -> None:
    cfg = build_config({**BASE, "batching": "pack", "tokens_per_step": 8192, "max_seq_len": 1024})
    p = tmp_path / "run.yaml"
    p.write_text(cfg.to_yaml())
    again = build_config(load_yaml(p))
    assert again == cfg


def test_every_field_is_documented() -> None:
    for name, f in FIELDS.items():
        assert f.metadata.get("help"), f"{name} has no help text"


def test_bad_yaml_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a directory"):
        load_yaml(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_yaml(scalar)


def test_cli_reports_all_problems_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("batchign: pack\nlr: [1]\n")
    out = tmp_path / "out"
    rc = main(
        [
            "train",
            "--config",
            str(cfg_file),
            "--model",
            "m",
            "--data",
            "d",
            "--output",
            str(out),
            "--max-seqlen",
            "5",
            "--precision",
            "fp8",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "4 problem(s)" in err
    assert "did you mean --max-seq-len?" in err
    assert "did you mean 'batching'?" in err
    assert "--precision is 'fp8'" in err
    assert "Traceback" not in err
    assert not out.exists(), "nothing may be written when the configuration is invalid"


def test_a_problem_is_said_of_where_the_value_came_from() -> None:
    """A value from the YAML file is named as the file's key, one from a flag as the flag
    (before, `lr: -1` in run.yaml was reported as "--lr must be positive")."""
    with pytest.raises(ConfigError) as e:
        build_config({**BASE, "lr": -1, "max_steps": 5}, {"max_steps": "0"}, source="run.yaml")
    text = e.value.render()
    assert "run.yaml: lr must be positive, got -1" in text and "--lr" not in text
    assert "--max-steps must be positive, got 0" in text and "run.yaml: max_steps" not in text


def test_an_empty_record_field_name_is_refused() -> None:
    """`--text-field ''` matched no record, and every record was then refused naming ''."""
    with pytest.raises(ConfigError, match=r"--text-field is empty; give a record field's name"):
        build_config(BASE, {"text_field": ""})
    assert build_config(BASE, {"input_field": ""}).input_field == ""  # optional: just absent
