"""Numbers and YAML that reach torch unchecked: every one is a ConfigError naming the flag.

Each case here used to be a traceback deep in torch (`--lr nan`, `--epochs inf`,
`--prefetch-factor 0` with workers, `--lora-dropout 7`) or was accepted and trained
wrongly (`--warmup-steps -5`, `--weight-decay -1`, `--save-minutes nan` never saved,
`--max-grad-norm nan` turned clipping off). A YAML alias bomb parsed cheaply and then
expanded into the error message.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from _rel import env

from pitstop.core.config import build_config
from pitstop.core.errors import ConfigError, short_repr
from pitstop.core.yaml_load import MAX_VALUES, parse_yaml

BASE = {"data": ["d.jsonl"], "model": "m", "output": "o"}

CASES = [
    ({"lr": "nan"}, "--lr must be a finite number, got nan"),
    ({"lr": "inf"}, "--lr must be a finite number, got inf"),
    ({"epochs": "nan"}, "--epochs must be a finite number, got nan"),
    ({"epochs": "inf"}, "--epochs must be a finite number, got inf"),
    ({"prefetch_factor": "0", "loader_workers": "2"}, "--prefetch-factor must be at least 1"),
    ({"prefetch_factor": "0"}, "--prefetch-factor must be at least 1"),  # auto may pick workers
    ({"lora_r": "8", "lora_dropout": "7"}, "--lora-dropout is a probability"),
    ({"lora_r": "8", "lora_dropout": "-0.1"}, "--lora-dropout is a probability"),
    ({"lora_r": "8", "lora_alpha": "0"}, "--lora-alpha must be positive"),
    ({"warmup_steps": "-5"}, "--warmup-steps must be 0 (no warm-up) or more, got -5"),
    ({"weight_decay": "-1"}, "--weight-decay must be 0 (off) or positive, got -1.0"),
    ({"weight_decay": "nan"}, "--weight-decay must be a finite number"),
    ({"save_minutes": "nan"}, "--save-minutes must be a finite number, got nan"),
    ({"max_grad_norm": "nan"}, "--max-grad-norm must be a finite number, got nan"),
    ({"min_lr_ratio": "nan"}, "--min-lr-ratio must be between 0 and 1, got nan"),
    ({"max_steps": "1e30"}, "--max-steps is an integer of 100 bits; it must be at most"),
    ({"seed": "-1"}, "--seed must be between 0 and 2**63 - 1"),
    ({"loader_workers": "-2"}, "--loader-workers must be 0 (the main process loads) or more"),
    ({"seed": str(2**77)}, "--seed must be between 0 and 2**63 - 1"),  # once, not twice
]


@pytest.mark.parametrize(("flags", "needle"), CASES, ids=[next(iter(c[0])) + "=" + next(iter(c[0].values())) for c in CASES])  # fmt: skip
def test_out_of_range_number_is_refused(flags, needle):
    with pytest.raises(ConfigError) as e:
        build_config({}, {**BASE, **flags}, command="tune")  # tune: flags only, no output dir
    assert needle in e.value.render()
    assert e.value.render().count("\n  - ") == 1, e.value.render()  # one message per problem


def test_valid_numbers_still_pass():
    cfg = build_config(
        {}, {**BASE, "lr": "1e-5", "warmup_steps": "0", "weight_decay": "0.1",
             "lora_r": "8", "lora_dropout": "0.05", "save_minutes": "0.5",
             "max_grad_norm": "0", "prefetch_factor": "0", "loader_workers": "0"},
        command="tune",
    )  # fmt: skip
    assert cfg.lr == 1e-5 and cfg.warmup_steps == 0 and cfg.lora_dropout == 0.05
    assert build_config({}, {**BASE, "seed": str(2**60)}, command="tune").seed == 2**60


def test_train_cli_refuses_nan_lr_without_traceback(tiny_model_dir, rel_store, tmp_path, capsys):
    from _rel import train_cmd

    from pitstop.cli import main

    out = tmp_path / "out"
    rc = main(train_cmd(tiny_model_dir, rel_store, out, "--lr", "nan")[3:])
    err = capsys.readouterr().err
    assert rc == 2 and "--lr must be a finite number, got nan" in err and "Traceback" not in err
    assert not out.exists()


def _bomb(levels: int = 9) -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        refs = ",".join([f"*a{i - 1}"] * 10)
        lines.append(f"a{i}: &a{i} [{refs}]")
    return "\n".join(lines) + f"\ndata: *a{levels - 1}\n"


def test_alias_bomb_is_refused_cheaply_in_a_small_memory(tmp_path):
    """A billion values in 700 bytes: refused before anything walks it, under a 1 GiB limit."""
    yml = tmp_path / "bomb.yaml"
    yml.write_text(_bomb())
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "from pitstop.cli import main\n"
        "sys.exit(main(['tune', '--config', sys.argv[1], '--model', 'm']))\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(yml)], env=env(), capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert "aliases (*name) expand to more than" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr) < 2000


def test_alias_that_contains_itself_is_refused():
    with pytest.raises(ConfigError, match="refers to a collection that contains it"):
        parse_yaml("a: &a [1, *a]\n", "x.yaml")


def test_modest_anchors_still_load():
    doc = parse_yaml("base: &b {lr: 0.001, seed: 3}\nrun1: *b\nrun2: *b\n", "x.yaml")
    assert doc["run2"] == {"lr": 0.001, "seed": 3}
    many = "a: &a [" + ",".join(["1"] * 1000) + "]\nb: [" + ",".join(["*a"] * 50) + "]\n"
    assert len(parse_yaml(many, "x.yaml")["b"]) == 50  # 51,000 values: under MAX_VALUES
    assert MAX_VALUES > 51_000


def test_a_huge_value_is_never_expanded_into_a_message():
    big = [["x"] * 1000] * 1000
    with pytest.raises(ConfigError) as e:
        build_config({"seed": big, "template": "y" * 100_000}, BASE, command="tune")
    assert len(e.value.render()) < 1000
    assert len(short_repr(big)) < 200
