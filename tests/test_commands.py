"""The command layer: configuration checked in one place, library functions the commands call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pitstop import cli
from pitstop.commands.flags import config_from_args
from pitstop.core.config import RunConfig, build_config, validate
from pitstop.core.errors import ConfigError
from pitstop.probe import DeviceInfo, preflight
from pitstop.report.planned import estimate_planned_run

CPU = DeviceInfo(type="cpu", name="test cpu", bf16=False)


def _args(argv: list[str]):
    args, unknown = cli.build_parser().parse_known_args(argv)
    args.unknown = unknown
    return args


def test_validate_checks_the_schema_only() -> None:
    # fp16 on a CPU and 4-bit weights across processes are the machine's and strategy's
    # problems: the schema has none with them, preflight names them.
    cfg = RunConfig(precision="fp16", lora_r=4, load_in_4bit=True, nproc=2)
    assert validate(cfg) == []
    problems = preflight(cfg, CPU)
    assert any("fp16" in p for p in problems)
    assert any("--load-in-4bit is single-process only" in p for p in problems)


def test_the_command_reports_every_problem_at_once(tmp_path: Path) -> None:
    args = _args(
        ["train", "--precision", "fp16", "--lr", "-1", "--max-sequ-len", "9", "--data", "d"]
    )
    with pytest.raises(ConfigError) as e:
        config_from_args(args, "train", device=CPU)
    text = e.value.render()
    assert e.value.exit_code == 2
    assert "unknown option --max-sequ-len (did you mean --max-seq-len?)" in text  # the flags
    assert "no model" in text and "no output directory" in text  # what train requires
    assert "--lr must be positive" in text  # the schema
    assert "fp16" in text  # the machine
    assert text.startswith(f"invalid configuration ({len(e.value.problems)} problem(s)):")


def test_train_refuses_an_output_holding_a_run_but_profile_does_not_care(tmp_path: Path) -> None:
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    base = ["--model", "m", "--data", "d", "--output", str(out)]
    with pytest.raises(ConfigError, match="already holds a run"):
        config_from_args(_args(["train", *base]), "train", device=CPU)
    y = tmp_path / "run.yaml"  # profile's own --output is the profile JSON; the YAML's is the run's
    y.write_text(f"model: m\ndata: [d]\noutput: {out}\n")
    cfg = config_from_args(_args(["profile", "--config", str(y)]), "profile", device=CPU)
    assert cfg.output == str(out)


def test_prepare_takes_no_machine_checks(tmp_path: Path) -> None:
    # prepare runs no model: a shared YAML asking for fp16 must not stop it on a CPU
    y = tmp_path / "run.yaml"
    y.write_text("precision: fp16\nmodel: m\ndata: [d]\n")
    cfg = config_from_args(_args(["prepare", "--config", str(y)]), "prepare", device=CPU)
    assert cfg.precision == "fp16"


def test_doctor_audits_a_config_without_data() -> None:
    cfg = build_config({"model": "m", "lr": 0.001}, command="doctor")
    assert cfg.data == []  # nothing is required of a config the doctor audits
    with pytest.raises(ConfigError, match="no data"):
        build_config({"model": "m"}, command="train")


def test_estimate_is_a_library_function_the_command_prints(capsys) -> None:
    est = estimate_planned_run(params=7e9, tokens=10_000_000, gpu="H100", mfu=0.4, price=2.0)
    assert est.gpu is not None and est.gpu.name.startswith("H100")
    argv = ["estimate", "--params", "7e9", "--tokens", "10_000_000", "--gpu", "H100"]
    assert cli.main([*argv, "--mfu", "0.4", "--price-per-gpu-hour", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == est.to_dict()


def test_estimate_reports_every_problem_at_once() -> None:
    with pytest.raises(ConfigError) as e:
        estimate_planned_run(precision="fp8", attention="magic", load_in_4bit=True)
    assert len(e.value.problems) == 6  # model, data, gpu, precision, attention, 4-bit


def test_every_config_field_is_in_exactly_one_help_group():
    from pitstop.commands.flags import HELP_GROUPS
    from pitstop.core.config import FIELDS

    placed = [name for names in HELP_GROUPS.values() for name in names]
    assert sorted(placed) == sorted(FIELDS), (
        set(FIELDS) ^ set(placed),
        "add the new field to one group of HELP_GROUPS in pitstop/commands/flags.py",
    )


def test_train_help_is_grouped_in_order(capsys):
    import pytest

    from pitstop.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    titles = [
        "data options:", "batching options:", "optimisation options:",
        "precision and speed options:", "LoRA and QLoRA options:",
        "checkpoints and results options:", "evaluation and logging options:",
    ]  # fmt: skip
    at = [out.index(t) for t in titles]
    assert at == sorted(at)
    # each flag sits under its group: --lr after "optimisation", before "precision"
    assert at[2] < out.index("\n  --lr ") < at[3] and at[4] < out.index("\n  --lora-r") < at[5]


@pytest.mark.parametrize("command", ["compare", "report"])
def test_a_bad_price_is_a_config_error_naming_the_flag(command, tmp_path, capsys):
    from pitstop.cli import main

    runs = [str(tmp_path / "a"), str(tmp_path / "b")]
    assert main([command, *runs, "--price-per-gpu-hour", "-2"]) == 2
    err = capsys.readouterr().err
    assert "--price-per-gpu-hour" in err and "Traceback" not in err
