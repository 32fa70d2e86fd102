"""Bad configuration through the real CLI: exit code 2, every problem named, nothing written.

tests/test_config.py covers build_config and one CLI case; here each kind of problem
the issue lists goes through `pitstop train` and the output directory is checked to be
untouched. Device checks that need no model (precision, attention, CUDA, output
directory) are listed with the flag problems; LoRA targets need the model, so they are
checked after it loads, still before anything is written.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _rel import train_cmd


class Uncaught(AssertionError):
    """The CLI let an exception escape: the user would see a traceback."""


def _tree(d: Path) -> list[tuple[str, int, int]]:
    return sorted(
        (str(p.relative_to(d)), p.stat().st_size, p.stat().st_mtime_ns) for p in d.rglob("*")
    )


def _train(model: Path, store: Path, out: Path, *extra: str, capsys) -> tuple[int, str]:
    from pitstop.cli import main

    try:
        rc = main(train_cmd(model, store, out, *extra, steps=2)[3:])
    except Exception as e:
        raise Uncaught(f"{type(e).__name__}: {str(e)[:300]}") from e
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def test_static_problems_are_reported_together(tiny_model_dir, rel_store, tmp_path, capsys):
    yml = tmp_path / "run.yaml"
    yml.write_text("warmup_step: 3\nlr: fast\nseed: [1]\nmax_grad_norm: -1\n")
    out = tmp_path / "out"
    rc, err = _train(tiny_model_dir, rel_store, out, "--config", str(yml), "--tokens-per-step", "100",
                     "--sav-steps", "2", "--epochs", "1", "--resume", "--overwrite",
                     "--micro-batch-size", "two", capsys=capsys)  # fmt: skip
    assert rc == 2
    assert "invalid configuration (9 problem(s))" in err, err
    for needle in (
        "unknown option 'warmup_step' (did you mean 'warmup_steps'?)",
        "run.yaml: lr must be a number, got 'fast'",
        "run.yaml: seed must be an integer, got [1]",
        "run.yaml: max_grad_norm must be 0 (off) or positive",  # the file gave it, not a flag
        "unknown option --sav-steps (did you mean --save-steps?)",
        "--micro-batch-size must be an integer, got 'two'",
        "--tokens-per-step 100 is not a whole number of packed rows of 64 tokens",
        "give --epochs or --max-steps, not both",
        "give --resume or --overwrite, not both",
    ):
        assert needle in err, needle
    assert not out.exists()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--precision", "fp16"], "fp16"),
        (["--attention", "flash_attention_2"], "flash-attn needs a CUDA GPU"),
        (["--attention", "flex_attention"], "FlexAttention has no backward on the CPU"),
        (["--device", "cuda"], "--device cuda was asked for"),
        (["--tokens-per-step", "32"], "below --max-seq-len 64"),
    ],
    ids=["fp16-cpu", "flash-attn-cpu", "flex-cpu", "cuda-missing", "step-below-row"],
)
def test_impossible_on_this_machine(extra, needle, tiny_model_dir, rel_store, tmp_path, capsys):
    out = tmp_path / "out"
    rc, err = _train(tiny_model_dir, rel_store, out, *extra, capsys=capsys)
    assert rc == 2 and needle in err, err[-2000:]
    assert not out.exists()


def test_device_problems_are_listed_with_the_flag_problems(
    tiny_model_dir, rel_store, tmp_path, capsys
):
    out = tmp_path / "out"
    rc, err = _train(
        tiny_model_dir, rel_store, out, "--precision", "fp16", "--sav-steps", "2", capsys=capsys
    )
    assert rc == 2 and "--sav-steps" in err
    assert "fp16" in err, err


def test_lora_targets_not_in_the_model(tiny_model_dir, rel_store, tmp_path, capsys):
    out = tmp_path / "out"
    rc, err = _train(tiny_model_dir, rel_store, out, "--lora-r", "4",
                     "--lora-target-modules", "nonexistent", capsys=capsys)  # fmt: skip
    assert rc == 2 and "nonexistent" in err
    assert "q_proj" in err, err  # the module names that exist are listed
    assert not out.exists()


@pytest.mark.parametrize("holds", ["summary.json", "checkpoints", "final"])
def test_output_holding_another_run_is_refused_untouched(
    holds, tiny_model_dir, rel_store, tmp_path, capsys
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file")
    if holds == "summary.json":
        (out / holds).write_text("{}")
    else:
        (out / holds).mkdir()
        (out / holds / "x").write_text("x")
    before = _tree(out)
    rc, err = _train(tiny_model_dir, rel_store, out, capsys=capsys)
    assert rc == 2
    assert "already holds a run; add --resume" in err and "--overwrite" in err
    assert _tree(out) == before


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*") if p.is_file()}


USER_FILES = {
    "config.yaml": "# my commented config\nlr: 0.001  # tuned by hand\n",
    "metrics.jsonl": '{"my":"notes"}\n',
    "report.html": "<html>my own report</html>\n",
}


@pytest.mark.parametrize("name", sorted(USER_FILES))
@pytest.mark.parametrize("flags", [[], ["--resume"]], ids=["plain", "resume"])
def test_users_file_at_a_name_the_run_writes_is_refused_untouched(
    name, flags, tiny_model_dir, rel_store, tmp_path, capsys
):
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_text(USER_FILES[name])
    (out / "notes.txt").write_text("the user's own file")
    before = _files(out)
    rc, err = _train(tiny_model_dir, rel_store, out, *flags, capsys=capsys)
    assert rc == 2, err[-2000:]
    assert f"is not a pitstop run but holds {name}" in err, err[-2000:]
    assert "another --output" in err and "--overwrite" in err
    assert _files(out) == before  # byte-identical, and nothing else written (no .lock)
    assert sorted(p.name for p in out.iterdir()) == sorted(before)


def test_config_inside_output_is_never_replaced(tiny_model_dir, rel_store, tmp_path, capsys):
    out = tmp_path / "ud6"
    out.mkdir()
    conf = out / "config.yaml"
    conf.write_text(USER_FILES["config.yaml"])
    (out / "metrics.jsonl").write_text(USER_FILES["metrics.jsonl"])
    before = _files(out)
    rc, err = _train(tiny_model_dir, rel_store, out, "--config", str(conf), capsys=capsys)
    assert rc == 2 and "holds config.yaml, metrics.jsonl" in err, err[-2000:]
    assert f"--config {conf} is {conf}, which the run replaces" in err
    # --overwrite lets the run replace a user's files at its names, but never --config's.
    rc, err = _train(tiny_model_dir, rel_store, out, "--config", str(conf), "--overwrite",
                     capsys=capsys)  # fmt: skip
    assert rc == 2 and f"--config {conf} is {conf}, which --overwrite removes" in err, err
    assert _files(out) == before
