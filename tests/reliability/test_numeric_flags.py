"""Hostile numbers on every command's numeric flags: exit 2, one line naming the flag.

`pitstop estimate --params nan` (or inf, or 1e30) used to search for the model's width
forever; `--mfu nan` printed "Time: nan h", `--price-per-gpu-hour nan` "+nan% cost";
`tune --budget-seconds nan` was accepted. Every numeric flag outside RunConfig now has
its range in `pitstop.core.config_ranges.FLAG_RANGES`, checked by `flag_problems` (parse-only
here, plus a few whole commands in a subprocess under a timeout); the RunConfig flags
of prepare/train/profile/tune are checked by `range_problems`.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys

import pytest
from _rel import env
from hypothesis import given, settings
from hypothesis import strategies as st

from pitstop import cli
from pitstop.core.config import FIELDS, build_config, field_type, unwrap_optional
from pitstop.core.config_ranges import COMMAND_FLAGS, FLAG_RANGES, flag_problems, parse_flag
from pitstop.core.errors import ConfigError
from pitstop.measure.cost_model import shape_from_params

HOSTILE = ["nan", "NaN", "inf", "-inf", "-1", "-0.5", "1e30", "-1e30", "1e309", "x"]
POSITIONALS = {"compare": ["a", "b"], "report": ["r"], "export": ["r"]}
CASES = [(c, n) for c, names in COMMAND_FLAGS.items() for n in names]
# What each command takes that is not a number (paths, names, choices, switches); a new
# flag must be added here or to COMMAND_FLAGS (or be a RunConfig field of a config command).
NOT_NUMBERS = {
    "prepare": {"config", "json"},
    "train": {"config"},
    "export": {"run", "merge", "output", "dtype"},
    "demo": {"output"},
    "doctor": {
        "config", "hf_args", "hf_class", "model", "data", "profile", "baseline", "json",
        "output", "gpu", "load_in_4bit", "transformers_version", "cache_dir",
        "no_compile_check",
    },
    "estimate": {
        "model", "data", "from_profile", "gpu", "optimizer", "load_in_4bit", "precision",
        "attention", "gradient_checkpointing", "cache_dir", "json",
    },
    "compare": {"run_a", "run_b", "rerun_output", "markdown", "json"},
    "report": {"runs", "output"},
    "profile": {"config", "profile_output", "trace", "json", "script_command"},
    "tune": {"config", "tuned_output", "run_output", "knobs", "no_trial_cache", "json",
             "dry_run", "allow_batch_changes", "script_command"},
}  # fmt: skip
CONFIG_COMMANDS = {"prepare", "train", "profile", "tune"}
RUNCONFIG_NUMBERS = [n for n in FIELDS if unwrap_optional(field_type(n))[0] in (int, float)]


@pytest.fixture(scope="module")
def subparsers() -> dict[str, argparse.ArgumentParser]:
    top = cli.build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _args(parsers, command: str, name: str, value: str) -> argparse.Namespace:
    flag = "--" + name.replace("_", "-")
    # --flag=value: a value starting with '-' is not taken for an option
    args, _ = parsers[command].parse_known_args([*POSITIONALS.get(command, []), f"{flag}={value}"])
    return args


def test_every_numeric_flag_is_in_the_table(subparsers):
    for command, parser in subparsers.items():
        dests = {a.dest for a in parser._actions} - {"help", "log_level", "quiet"}
        numeric = set(COMMAND_FLAGS.get(command, ()))
        assert numeric <= dests, (command, numeric - dests)
        rest = dests - numeric - NOT_NUMBERS[command]
        if command in CONFIG_COMMANDS:
            rest -= set(FIELDS)
        assert not rest, (
            f"pitstop {command}: classify {sorted(rest)} (COMMAND_FLAGS or NOT_NUMBERS)"
        )
        typed = [a.dest for a in parser._actions if a.type in (int, float)]
        assert not typed, f"{command}: argparse type= would refuse before the range check: {typed}"


@pytest.mark.parametrize("value", HOSTILE)
@pytest.mark.parametrize(("command", "name"), CASES, ids=[f"{c}-{n}" for c, n in CASES])
def test_hostile_value_is_one_line_naming_the_flag(subparsers, command, name, value):
    args = _args(subparsers, command, name, value)
    problems = flag_problems(args, command)
    assert len(problems) == 1, problems
    flag = "--" + name.replace("_", "-")
    assert problems[0].startswith(f"{flag} {value}: must be "), problems[0]
    assert "; give " in problems[0] and "\n" not in problems[0]


@pytest.mark.parametrize("command", sorted(COMMAND_FLAGS))
def test_each_command_checks_its_flags_first(subparsers, command):
    """The command itself (args.func, as the CLI calls it) refuses before any work: exit 2."""
    name = COMMAND_FLAGS[command][0]
    args = _args(subparsers, command, name, "nan")
    args.unknown = []
    with pytest.raises(ConfigError) as e:
        args.func(args)
    assert e.value.exit_code == 2
    assert e.value.problems[0].startswith("--" + name.replace("_", "-") + " nan: must be ")


values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(min_value=-(10**40), max_value=10**40).map(str),
    st.sampled_from(HOSTILE),
)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(FLAG_RANGES)), raw=values)
def test_any_number_is_in_range_or_refused(name, raw):
    r = FLAG_RANGES[name]
    value, problem = parse_flag(name, raw)
    if problem is None:
        for v in value if r.many else [value]:
            assert math.isfinite(v) and r.lo <= v <= r.hi and not (r.lo_open and v == r.lo)
            assert not r.integer or isinstance(v, int)
    else:
        assert value is None and "\n" not in problem
        assert problem.startswith("--" + name.replace("_", "-") + " ")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e30"])
@pytest.mark.parametrize("name", RUNCONFIG_NUMBERS)
def test_runconfig_numbers_refuse_hostile_values(name, value):
    base = {"data": ["d.jsonl"], "model": "m", "output": "o", "lora_r": "8"}
    if name == "lora_r":
        base.pop("lora_r")
    with pytest.raises(ConfigError) as e:
        build_config({}, {**base, name: value}, command="tune")
    assert "--" + name.replace("_", "-") in e.value.render()


@pytest.mark.parametrize("n", [math.nan, math.inf, -math.inf, 1e30, 0.0, -1.0])
def test_width_search_is_bounded(n):
    """Even past the flag check (a caller of the cost model), no endless search."""
    with pytest.raises(ValueError):
        shape_from_params(n)
    assert shape_from_params(1e15).hidden > shape_from_params(7e9).hidden == 4096


E2E = [
    ("estimate", ["--params", "nan", "--tokens", "1e9", "--gpu", "H100"], "--params"),
    ("estimate", ["--params", "inf", "--tokens", "1e9", "--gpu", "H100"], "--params"),
    ("estimate", ["--params", "1e30", "--tokens", "1e9", "--gpu", "H100"], "--params"),
    ("estimate", ["--params", "7e9", "--tokens", "1e9", "--gpu", "H100", "--mfu", "nan"], "--mfu"),
    ("estimate", ["--params", "7e9", "--tokens", "1e9", "--gpu", "H100",
                  "--price-per-gpu-hour", "nan"], "--price-per-gpu-hour"),
    ("tune", ["--budget-seconds", "nan"], "--budget-seconds"),
]  # fmt: skip


@pytest.mark.parametrize(("command", "argv", "flag"), E2E, ids=[f"{c}{a[:2]}" for c, a, _ in E2E])
def test_cli_refuses_without_hanging(command, argv, flag):
    done = subprocess.run(
        [sys.executable, "-m", "pitstop", command, *argv],
        env=env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "nan" not in done.stdout.lower()
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"error: {flag} " in lines[0], done.stderr
