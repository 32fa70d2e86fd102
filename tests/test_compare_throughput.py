"""`compare`'s throughput counts every stall, its band stays positive, ranks are totalled.

Issue 36: a loader whose workers are all busy every Nth step makes that step wait; the
median of per-step rates left those waits out (a 4x speed-up read 7.2x). The steady
throughput is the steady steps' trained tokens over their seconds; its band comes from
blocks of steps. A torchrun run's tokens are totalled over its ranks.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from pathlib import Path

import pytest

import pitstop
from pitstop.report.compare import compare, format_compare
from pitstop.report.runs import load_run
from pitstop.report.steady import NOISE_FLOOR, Steady, band, blocks, period, steady

pytestmark = pytest.mark.usefixtures("one_thread")

# Every 4th item's load: a sleep, which a busy machine does not stretch, long against the
# tiny model's step even when a busy loop beside the suite stretches that step (at 0.06 s
# the blocks' spread reached 42% there and read as a noisy run).
STALL_S = 0.2
STEPS = 33


def _watched_loop(out: Path, stall_every: int) -> list[float]:
    """Train a tiny model on batches of one row; item i sleeps when i % stall_every == 3.
    Returns the loop's own clock: the time after each optimizer step."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    class Items(Dataset):
        def __len__(self) -> int:
            return STEPS

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            if stall_every and i % stall_every == stall_every - 1:
                time.sleep(STALL_S)
            ids = (torch.arange(16) + i) % 50
            return {"input_ids": ids, "labels": ids.roll(-1)}

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Items(), batch_size=1)
    clock = []
    with pitstop.watch(output=out, warmup_steps=1, print_report=False, doctor=False):
        for batch in loader:
            logits = model(batch["input_ids"])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            clock.append(time.perf_counter())
    return clock


def test_periodic_stalls_are_in_the_throughput_and_the_ratio(tmp_path: Path) -> None:
    clock = _watched_loop(tmp_path / "stalls", stall_every=4)
    _watched_loop(tmp_path / "smooth", stall_every=0)
    run = load_run(tmp_path / "stalls")
    st = steady(run)
    assert st is not None and st.warmup == 1 and st.steps == STEPS - 1
    steady_lines = [r for r in run.steps if not r.warmup]
    tokens = sum(r.step_trained_tokens for r in steady_lines)
    # The loop's own clock over the same steps (from the end of the warm-up step): the
    # throughput must be total tokens over total time, within 5%.
    own = tokens / (clock[-1] - clock[0])
    assert st.tokens_per_second == pytest.approx(own, rel=0.05)
    # What a median of per-step rates said: the stalled steps left out, far above the truth.
    median = statistics.median(r.step_trained_tokens / r.step_seconds for r in steady_lines)
    assert median > 1.3 * st.tokens_per_second

    res = compare(tmp_path / "stalls", tmp_path / "smooth")
    tps = next(r for r in res["metrics"] if r["metric"] == "tokens_per_second")
    sb = steady(load_run(tmp_path / "smooth"))
    assert sb is not None and sb.tokens_per_second is not None
    # The headline ratio is the ratio of those throughputs.
    assert tps["ratio"] == pytest.approx(sb.tokens_per_second / st.tokens_per_second, rel=1e-9)
    assert tps["verdict"] == "better"
    # The stalls recur within every block: not a noisy run, though its steps vary 5-fold.
    # (the machine's own load may still flag it: another test run on this 2-core box)
    assert not [r for r in res["steady"]["a"]["noisy"] if "spread" in r], res["steady"]["a"]
    # The data-wait share covers the same steady steps as the throughput.
    share = next(r for r in res["metrics"] if r["metric"] == "data_wait_share")["a"]
    waits = sum(r.data_wait_s for r in steady_lines) / sum(r.step_seconds for r in steady_lines)
    assert share == pytest.approx(waits)


def test_blocks_tile_the_steps() -> None:
    for n in range(1, 200):
        bs = blocks(n)
        assert bs[0][0] == 0 and bs[-1][1] == n
        assert all(a < b for a, b in bs) and all(x[1] == y[0] for x, y in itertools.pairwise(bs))
        assert max(b - a for a, b in bs) <= math.isqrt(n) + math.isqrt(n)  # about √n each


def test_a_periodic_stall_gives_blocks_of_whole_periods_and_a_narrow_band(tmp_path: Path) -> None:
    import random

    rng = random.Random(0)
    # every 4th step waits 0.08 s for data on top of ~0.03 s: a loader with 4 workers
    secs = [0.03 * (1 + rng.uniform(-0.05, 0.05)) + (0.08 if i % 4 == 3 else 0.0)
            for i in range(60)]  # fmt: skip
    assert period(secs) == 4
    bs = blocks(len(secs), 4)
    assert len(bs) >= 2 and all((b - a) % 4 == 0 for a, b in bs)
    assert period([0.03 * (1 + rng.uniform(-0.2, 0.2)) for _ in range(60)]) == 1
    st = steady(load_run(_synthetic(tmp_path / "r", [0.2, *secs])))
    assert st is not None and st.spread < 0.05  # each block holds the same stalls
    # Blocks of ⌊√59⌋ = 7 steps hold one stall or two: the band would be several times wider.
    rates = [(b - a) / sum(secs[a:b]) for a, b in blocks(len(secs))]
    assert statistics.stdev(rates) / statistics.fmean(rates) > 3 * st.spread


@pytest.mark.parametrize("rel_se", [0.0, 0.01, 0.3, 1.0, 5.0, 50.0])
def test_no_band_has_a_negative_bound(rel_se: float) -> None:
    a = Steady(4, 1, 1.0, 100.0, rel_se * 2, rel_se, 2)
    b = Steady(4, 1, 2.0, 50.0, 0.0, rel_se, 2, noisy=["load 9.0 on 2 cores"] if rel_se else [])
    lo, hi = band(a, b)
    assert 0 < lo < 1 < hi and lo * hi == pytest.approx(1.0)
    assert hi >= 1 + NOISE_FLOOR - 1e-12


def test_wildly_noisy_runs_give_a_positive_band_in_the_table(tmp_path: Path) -> None:
    a = _synthetic(tmp_path / "a", [0.1, 5.0, 0.1, 9.0, 0.2])
    b = _synthetic(tmp_path / "b", [3.0, 0.1, 7.0, 0.1, 0.1])
    res = compare(a, b)
    assert res["noise_band"][0] > 0
    for row in res["metrics"]:
        if row["band"]:
            assert row["band"][0] > 0
    assert "band -" not in format_compare(res)


def _synthetic(
    dest: Path,
    secs: list[float],
    *,
    tokens: int = 100,
    world_size: int | None = None,
    source: str = "script",
    machine: dict | None = None,
) -> Path:
    dest.mkdir(parents=True)
    lines, cum = [], 0
    for i, s in enumerate(secs, 1):
        cum += tokens
        lines.append({"step": i, "warmup": i == 1, "trained_tokens": cum,
                      "step_trained_tokens": tokens, "step_seconds": s, "forward_s": s})  # fmt: skip
    (dest / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = {
        "status": "completed", "source": source, "trained_tokens": cum,
        "tokens_per_second": cum / sum(secs),
        "optimizer_steps": len(secs), "train_seconds": sum(secs), "wall_seconds": sum(secs) + 1,
        "world_size": world_size, "machine": machine or {"load_average_1m": 0.1, "cpu_cores": 2},
    }  # fmt: skip
    (dest / "summary.json").write_text(json.dumps(summary))
    return dest


def test_a_torchrun_run_is_totalled_over_its_ranks(tmp_path: Path) -> None:
    # One process, then two: each rank trains the same batch per step (the effective batch
    # doubles), each step 1.56x slower. Rank 0's counts (a profiled command) x 2 ranks.
    one = _synthetic(tmp_path / "one", [0.1] * 12, tokens=4088)
    two = _synthetic(tmp_path / "two", [0.156] * 12, tokens=4088, world_size=2)
    res = compare(one, two)
    row = {r["metric"]: r for r in res["metrics"]}
    assert row["world_size"]["a"] == 1 and row["world_size"]["b"] == 2
    assert row["tokens_per_second"]["ratio"] == pytest.approx(2 / 1.56)
    assert row["rank_tokens_per_second"]["ratio"] == pytest.approx(1 / 1.56)
    assert row["trained_tokens_per_step"]["ratio"] == pytest.approx(2.0)
    notes = " ".join(res["notes"])
    assert "A ran 1 process(es), B 2" in notes and "effective batch changed" in notes
    assert "tokens/s per rank (steady)" in format_compare(res)
    # `pitstop train` sums every rank's tokens already: not scaled again.
    summed = _synthetic(tmp_path / "summed", [0.156] * 12, tokens=8176, world_size=2,
                        source="pitstop")  # fmt: skip
    row = {r["metric"]: r for r in compare(two, summed)["metrics"]}
    assert row["tokens_per_second"]["ratio"] == pytest.approx(1.0)
    assert row["trained_tokens"]["ratio"] == pytest.approx(1.0)


def test_same_settings_on_a_noisy_machine_blames_the_machine(tmp_path: Path) -> None:
    quiet = _synthetic(tmp_path / "quiet", [0.1] * 12)
    busy = {"load_average_1m": 3.2, "cpu_cores": 2}
    loaded = _synthetic(tmp_path / "loaded", [0.3] * 12, machine=busy)
    res = compare(quiet, loaded)
    assert not res["settings_differ"]
    assert any("comes from the machine, not the configuration" in n for n in res["notes"])


def test_estimate_reads_one_gpu_of_a_multi_rank_run(tmp_path: Path) -> None:
    from pitstop.report.measured import load_measured

    one = load_measured(_synthetic(tmp_path / "one", [0.1] * 12, tokens=4000))
    # pitstop train on 2 ranks sums both ranks' tokens: one GPU's rate is half of them.
    summed = load_measured(
        _synthetic(tmp_path / "two", [0.1] * 12, tokens=8000, world_size=2, source="pitstop")
    )
    # a profiled command on 2 ranks counts rank 0's batches: already one GPU's.
    rank0 = load_measured(_synthetic(tmp_path / "r0", [0.1] * 12, tokens=4000, world_size=2))
    for m in (summed, rank0):
        assert m.tokens_per_second == pytest.approx(one.tokens_per_second)
        assert m.tokens_per_step == pytest.approx(4000)
        assert m.steady is not None and one.steady is not None
        assert m.steady.tokens_per_second == pytest.approx(one.steady.tokens_per_second)
    assert summed.summed_ranks == 2 and rank0.summed_ranks == 1


def test_an_estimate_defaults_to_the_whole_runs_tokens_at_its_own_packing() -> None:
    """A profiled command on 2 ranks counted rank 0's tokens: the run trained twice them,
    and its packing efficiency is a ratio, the same on every rank (it once read 2x)."""
    from pitstop.core.run_record import RunSummary
    from pitstop.report.measured import Measured
    from pitstop.report.planned import run_defaults

    s = RunSummary(source="script", world_size=2, trained_tokens=100.0, seen_tokens=120.0,
                   padded_tokens=150.0)  # fmt: skip
    assert s.whole_run_factor == 2.0
    _, tokens = run_defaults(Measured("run/summary.json", 1.0, "cpu"), s)
    assert tokens is not None
    assert (tokens.trained_tokens, tokens.tokens) == (200, 240)
    assert tokens.packing_efficiency == pytest.approx(0.8)
    summed = RunSummary(source="pitstop", world_size=2, trained_tokens=200.0)
    assert summed.whole_run_factor == 1.0
