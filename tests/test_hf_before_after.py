"""Before and after, with two Hugging Face Trainer runs made with PitstopCallback (CPU).

Before: per-device batch 2 x accumulation 8, rows tokenized to at most 512 tokens, no
loader workers. After: 2 x 4, two loader workers, tf32 asked for (TrainingArguments
refuses tf32 without an Ampere GPU, so it is recorded through `requested`). Both
directories must go through `pitstop compare`, `pitstop report` and
`estimate --from-profile`, and the comparison must say that the after step holds
fewer trained tokens, next to the steps/s and tokens/s ratios.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from transformers import (
    AutoModelForCausalLM,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
)

from pitstop.cli import main
from pitstop.core.corpus import sample_texts
from pitstop.hf import PitstopCallback
from pitstop.report.compare import compare

STEPS = 3


class Rows:
    def __init__(self, rows: list[list[int]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.rows[i]}


def _hf_run(model_dir: Path, tok, out: Path, batch: int, accum: int, workers: int, **req) -> Path:
    rows = [tok(t, truncation=True, max_length=512)["input_ids"] for t in sample_texts(64)]
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    args = TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=batch,
        gradient_accumulation_steps=accum, dataloader_num_workers=workers, report_to=[],
        use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
    )  # fmt: skip
    # One cache for both runs: the CPU's peak FLOP/s (for MFU) is measured once.
    cb = PitstopCallback(
        print_report=False, cache_dir=out.parent / "cache", requested={"max_length": 512, **req}
    )
    Trainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        args=args,
        train_dataset=Rows(rows),
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        callbacks=[cb],
    ).train()
    return out


@pytest.fixture(scope="module")
def before_after(tiny_model_dir: Path, tiny_tokenizer, tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("before_after")
    before = _hf_run(tiny_model_dir, tiny_tokenizer, base / "before", 2, 8, 0)
    after = _hf_run(tiny_model_dir, tiny_tokenizer, base / "after", 2, 4, 2, tf32=True)
    return before, after


def test_callback_writes_the_run_format(before_after: tuple[Path, Path]) -> None:
    before, _ = before_after
    s = json.loads((before / "summary.json").read_text())
    lines = [json.loads(x) for x in (before / "metrics.jsonl").read_text().splitlines()]
    assert s["source"] == "hf" and s["optimizer_steps"] == STEPS == len(lines)
    # Cumulative counts end at the summary's; each step trains what its rows' labels hold.
    assert lines[-1]["trained_tokens"] == s["trained_tokens"] > 0
    assert sum(r["step_trained_tokens"] for r in lines) == s["trained_tokens"]
    assert all(r["step_rows"] == 16 for r in lines)  # 2 rows x 8 micro-batches
    assert s["seen_tokens"] <= s["padded_tokens"] and s["trained_tokens"] < s["seen_tokens"]
    assert s["tokens_per_second"] == pytest.approx(s["trained_tokens"] / s["train_seconds"])
    assert all(r["loss"] is not None for r in lines)  # logging_steps=1
    assert s["final_loss"] == lines[-1]["loss"]
    # The callback's doctor measured the Trainer's dataset: no "waste not measured" finding.
    findings = json.loads((before / "findings.json").read_text())["findings"]
    assert "packing-off" not in {f["id"] for f in findings}
    assert json.loads((before / "pitstop_profile.json").read_text())["machine"]["cpu_cores"] >= 1


def test_compare_shows_both_ratios_and_flags_fewer_tokens_per_step(
    before_after: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    before, after = before_after
    res = compare(before, after)
    by = {r["metric"]: r for r in res["metrics"]}
    for key in ("iterations_per_second", "tokens_per_second", "trained_tokens_per_step"):
        assert by[key]["ratio"] is not None and by[key]["ratio"] > 0
    # Half the micro-batches per step: about half the trained tokens per step.
    assert 0.3 < by["trained_tokens_per_step"]["ratio"] < 0.7
    assert any("fewer trained tokens" in n and "not a speed-up" in n for n in res["notes"])
    diffs = {d["setting"]: (d["a"], d["b"]) for d in res["settings_differ"]}
    assert diffs["gradient_accumulation_steps"] == (8, 4)
    assert diffs["dataloader_num_workers"] == (0, 2)
    assert diffs["requested.tf32"] == ("-", True)
    assert "output_dir" not in diffs

    assert main(["compare", str(before), str(after)]) == 0
    out = capsys.readouterr().out
    assert "optimizer steps/s" in out and "tokens/s" in out and "trained tokens/step" in out
    assert "a faster step is not a speed-up when the step holds fewer tokens" in out


def test_report_and_estimate_read_hf_runs(
    before_after: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before, after = before_after
    html = tmp_path / "r.html"
    assert main(["report", str(before), str(after), "--output", str(html)]) == 0
    text = html.read_text()
    assert "fewer trained tokens" in text and "gradient_accumulation_steps" in text
    capsys.readouterr()
    code = main(["estimate", "--from-profile", str(after), "--params", "1e6", "--tokens", "1e6"])
    out = capsys.readouterr().out
    assert code == 0 and "measured" in out
    # The load it was measured under; where other processes or the hypervisor took CPU,
    # that follows ("...; other processes used 0.6 of 2 cores (0.1 of it stolen by the
    # hypervisor) when measured": CI's host once put the steal between "cores" and "when").
    assert re.search(
        r"machine load [\d.]+ on \d+ cores(; other processes [^\n]*)? when measured", out
    ), out
