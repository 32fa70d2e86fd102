"""`batching: auto` picks by measured speed; a fake clock makes the measurement deterministic."""

from __future__ import annotations

import pytest
import torch
from test_batching_support import long_tailed_lengths, make_store

from pitstop.batching.auto import choose_batching
from pitstop.core.config import RunConfig

pytestmark = pytest.mark.usefixtures("one_thread")

MSL = 128


@pytest.fixture()
def store(tmp_path):
    return make_store(tmp_path / "s", long_tailed_lengths(600, MSL), max_seq_len=MSL)


class FakeDevice:
    """A 'device' whose time per micro-batch is a cost model of its shape."""

    def __init__(self, per_position: float, packed_penalty: float = 0.0) -> None:
        self.now = 0.0
        self.per_position = per_position
        self.packed_penalty = packed_penalty
        self.calls = 0

    def clock(self) -> float:
        return self.now

    def run(self, batch) -> None:
        self.calls += 1
        B, T = batch["input_ids"].shape
        packed = (batch["position_ids"][:, 1:] == 0).any().item()
        self.now += B * T * self.per_position * (1 + (self.packed_penalty if packed else 0.0))


def test_timing_is_spent_only_where_the_planned_run_repays_it(store):
    """A short run: timing the layouts would cost more than a 5% lead could save over the
    run, so nothing is timed and the fewest positions win, the banner saying why with the
    numbers. A long run of the same configuration times them."""
    short = RunConfig(max_seq_len=MSL, tokens_per_step=8 * MSL, max_steps=2)
    dev = FakeDevice(1e-6)
    choice = choose_batching(store, short, dev.run, clock=dev.clock, seconds_per_position=1e-6)
    assert dev.calls == 0 and choice.rounds == 0 and choice.timings == {}
    assert choice.unpaid is not None and not choice.unpaid.worth
    assert choice.strategy == "pack"  # the fewest positions
    assert "not timed: timing the layouts would not pay on this run" in choice.reason
    assert f"~{choice.unpaid.cost_s:.1f} s" in choice.reason
    long = RunConfig(max_seq_len=MSL, tokens_per_step=8 * MSL, epochs=1000)
    timed = choose_batching(store, long, dev.run, clock=dev.clock, seconds_per_position=1e-6)
    assert dev.calls == 2 * (1 + 3 * 4) and timed.unpaid is None and timed.rounds == 3
    # Without an estimate (no device peak) it times, as before.
    plain = FakeDevice(1e-6)
    choose_batching(store, short, plain.run, clock=plain.clock)
    assert plain.calls > 0


def test_untimed_sdpa_docs_on_a_gpu_keeps_one_document_per_row(store):
    """sdpa_docs on a GPU pays a launch per packed document, which positions do not count
    (an H200 trained 2.6x slower with pack untimed than with the timed bucket): when timing
    would not pay, the fewest positions among the layouts of one document per row win."""
    short = RunConfig(max_seq_len=MSL, tokens_per_step=8 * MSL, max_steps=2)
    dev = FakeDevice(1e-6)

    class OnGpu:  # the trainer's micro-batch runner names its kernel and device
        attention, device_type = "sdpa_docs", "cuda"

        def __call__(self, batch) -> None:
            dev.run(batch)

    choice = choose_batching(store, short, OnGpu(), clock=dev.clock, seconds_per_position=1e-6)
    assert dev.calls == 0 and choice.unpaid is not None and not choice.unpaid.worth
    assert choice.strategy == "bucket" and "pack left out" in choice.reason


def test_auto_picks_the_fastest_measured_strategy(store):
    cfg = RunConfig(max_seq_len=MSL, tokens_per_step=8 * MSL)
    dev = FakeDevice(1e-6)
    choice = choose_batching(store, cfg, dev.run, clock=dev.clock)
    assert choice.strategy == "pack"  # cost ∝ positions: least padding wins
    # pad is never timed where bucket exists (the same rows, padded more)
    assert set(choice.timings) == {"pack", "bucket"} and "cannot win" in choice.skipped["pad"]
    # warm-up + 3 interleaved rounds over 4 strata: a noiseless clock ranks alike every round
    assert dev.calls == 2 * (1 + 3 * 4) and choice.rounds == 3 and choice.noise < 1e-9
    t = choice.timings
    assert t["pack"].tokens_per_second > t["bucket"].tokens_per_second
    assert t["pack"].packing_efficiency > t["bucket"].packing_efficiency
    assert "pack" in choice.reason and "trained tok/s" in choice.reason
    assert "fewest positions" in choice.reason and "noise ±0.0%" in choice.reason
    # If packed rows were much slower per position (e.g. a mask that blocks a fast kernel),
    # bucketing would win: the choice follows the measurement, not a rule.
    slow_pack = FakeDevice(1e-6, packed_penalty=2.0)
    assert choose_batching(store, cfg, slow_pack.run, clock=slow_pack.clock).strategy == "bucket"


def test_with_per_document_attention_the_cost_model_picks_the_leanest_untimed(store):
    cfg = RunConfig(max_seq_len=MSL, tokens_per_step=8 * MSL)
    dev = FakeDevice(1e-6, packed_penalty=2.0)  # would make bucket win if it were timed

    def run(batch):
        dev.run(batch)

    run.attention = "sdpa_docs"
    choice = choose_batching(store, cfg, run, clock=dev.clock)
    assert choice.strategy == "pack" and dev.calls == 0 and choice.rounds == 0
    assert choice.reason.startswith("cost model, not timed: with per-document attention")
    assert (
        "pack" in choice.reason and "% real" in choice.reason and "pad not timed" in choice.reason
    )
    # Micro-batches of one row leave bucket no padding: the leanest, so bucket, untimed.
    one_row = RunConfig(max_seq_len=MSL, tokens_per_step=8 * MSL, micro_batch_size=1)
    lean = choose_batching(store, one_row, run, clock=dev.clock)
    table = lean.reason.split("is the cheapest: ")[1]
    assert lean.strategy == "bucket" and dev.calls == 0 and table.startswith("bucket")
    # A dense-mask kernel: measured, and the measurement decides.
    run.attention = "sdpa"
    assert choose_batching(store, cfg, run, clock=dev.clock).strategy == "bucket"
    assert dev.calls > 0
    # sdpa_docs on a GPU pays a launch per document, which positions do not count: timed.
    run.attention, run.device_type, dev.calls = "sdpa_docs", "cuda", 0
    assert choose_batching(store, cfg, run, clock=dev.clock).strategy == "bucket"
    assert dev.calls > 0
    run.attention = "flash_attention_2"  # one varlen kernel: the cost model holds on a GPU
    assert choose_batching(store, cfg, run, clock=dev.clock).strategy == "pack"


def test_auto_skips_pack_when_steps_are_not_whole_rows(store):
    cfg = RunConfig(max_seq_len=MSL, tokens_per_step=8 * MSL + 7)
    dev = FakeDevice(1e-6)
    choice = choose_batching(store, cfg, dev.run, clock=dev.clock)
    assert "pack" in choice.skipped and choice.strategy == "bucket"
    assert "pack skipped" in choice.reason


def test_auto_with_a_real_tiny_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from pitstop.tiny import llama_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(256, layers=1, hidden=32, heads=2))

    def run(batch):
        out = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            labels=batch["labels"],
            use_cache=False,
        )
        out.loss.backward()

    small = make_store(tmp_path / "small", long_tailed_lengths(120, 64), max_seq_len=64)
    cfg = RunConfig(max_seq_len=64, tokens_per_step=4 * 64)
    choice = choose_batching(small, cfg, run, samples=2)
    assert choice.strategy in ("pack", "bucket", "pad")
    assert all(t.epoch_seconds > 0 for t in choice.timings.values())


def test_a_burst_of_background_load_does_not_decide(store):
    """One slow timing (another process grabbed the CPU) is filtered by the best-of-rounds."""
    cfg = RunConfig(max_seq_len=MSL, tokens_per_step=8 * MSL)

    class Bursty(FakeDevice):
        def run(self, batch) -> None:
            before = self.now
            super().run(batch)
            # The first timed sample (call 4, after one warm-up per layout) is pack's and
            # lands in a 100x burst of background load.
            if self.calls == 4:
                self.now += 100 * (self.now - before)

    dev = Bursty(1e-6, packed_penalty=-0.5)  # packed rows are truly the cheapest here
    choice = choose_batching(store, cfg, dev.run, clock=dev.clock)
    assert choice.strategy == "pack"


class Jittery(FakeDevice):
    """Each micro-batch takes its modelled time x a seeded factor in [1, 1 + jitter]."""

    def __init__(self, jitter: float, speedup: dict[str, float], seed: int = 0) -> None:
        super().__init__(1e-6)
        import random

        self.rng = random.Random(seed)
        self.jitter = jitter
        self.speedup = speedup

    def run(self, batch) -> None:
        self.calls += 1
        B, T = batch["input_ids"].shape
        packed = (batch["position_ids"][:, 1:] == 0).any().item()
        full = T == MSL and not packed
        kind = "pack" if packed else ("pad" if full else "bucket")
        factor = 1 + self.rng.uniform(0, self.jitter)
        self.now += B * T * self.per_position * self.speedup.get(kind, 1.0) * factor


def test_a_layout_with_more_positions_needs_an_advantage_beyond_the_noise(store):
    cfg = RunConfig(max_seq_len=MSL, tokens_per_step=8 * MSL)
    # bucket computes more positions; make its positions so cheap that its epoch is only
    # ~3% faster than pack's: within MIN_ADVANTAGE, so the leanest layout (pack) stays.
    base = choose_batching(store, cfg, FakeDevice(1e-6).run, clock=FakeDevice(1e-6).clock)
    pos = {k: t.positions for k, t in base.timings.items()}
    assert pos["pack"] < pos["bucket"]
    near = {"bucket": 0.97 * pos["pack"] / pos["bucket"]}
    dev = Jittery(0.0, near)
    choice = choose_batching(store, cfg, dev.run, clock=dev.clock)
    assert choice.timings["bucket"].epoch_seconds < choice.timings["pack"].epoch_seconds
    assert choice.strategy == "pack" and "not ahead by more than the noise" in choice.reason
    # Clearly faster (30%): bucket wins on the measurement.
    far = {"bucket": 0.7 * pos["pack"] / pos["bucket"]}
    dev = Jittery(0.0, far)
    assert choose_batching(store, cfg, dev.run, clock=dev.clock).strategy == "bucket"
    # A 12% advantage measured with ±20% jitter per micro-batch: repeated rounds, the
    # noise is reported, and the layout with the fewest positions keeps its place
    # unless the advantage beats the measured noise.
    mid = {"bucket": 0.88 * pos["pack"] / pos["bucket"]}
    for seed in range(3):
        dev = Jittery(0.4, mid, seed=seed)
        choice = choose_batching(store, cfg, dev.run, clock=dev.clock)
        assert choice.noise > 0 and f"noise ±{choice.noise:.1%}" in choice.reason
        t = choice.timings
        beats = t["bucket"].epoch_seconds < t["pack"].epoch_seconds * (1 - max(choice.noise, 0.05))
        assert choice.strategy == ("bucket" if beats else "pack"), (seed, choice.reason)
        assert 3 <= choice.rounds <= 8


def test_auto_reports_progress_each_round(store):
    cfg = RunConfig(max_seq_len=MSL, tokens_per_step=8 * MSL)
    dev = FakeDevice(1e-6)
    lines: list[str] = []
    choice = choose_batching(store, cfg, dev.run, clock=dev.clock, progress=lines.append)
    assert len(lines) == choice.rounds and "round 1" in lines[0]


def test_auto_times_a_sample_of_steps_and_scales_it_to_the_epoch(store, monkeypatch):
    """Only SAMPLED_STEPS steps' micro-batches are built (a Python object per micro-batch of
    a 10M-document epoch would be gigabytes), and the estimate is scaled to the epoch: with
    a time per position, the sampled estimate is the whole-epoch one."""
    import pitstop.batching.auto as auto

    cfg = RunConfig(max_seq_len=MSL, tokens_per_step=4 * MSL)
    whole = FakeDevice(1e-6)
    full = choose_batching(store, cfg, whole.run, clock=whole.clock)
    built: list[int] = []
    real = auto.step_micro_batches

    def counting(plan, step, *a, **k):
        built.append(step)
        return real(plan, step, *a, **k)

    monkeypatch.setattr(auto, "step_micro_batches", counting)
    monkeypatch.setattr(auto, "SAMPLED_STEPS", 5)
    dev = FakeDevice(1e-6)
    sampled = choose_batching(store, cfg, dev.run, clock=dev.clock)
    # 5 steps of pack and of bucket; pad (never timed: bucket holds its rows padded less) is
    # counted from bucket's plan, with no micro-batch built
    assert len(set(built)) == 5 and len(built) == 2 * 5, built
    assert min(built) == 0 and max(built) > 20  # spread over an epoch longer than the sample
    assert sampled.strategy == full.strategy
    for k, t in sampled.timings.items():
        f = full.timings[k]
        assert t.positions == f.positions and t.packing_efficiency == f.packing_efficiency
        # time ∝ positions: the scaled sample estimates the epoch within the strata's error
        assert t.epoch_seconds == pytest.approx(f.epoch_seconds, rel=0.15), k
        assert t.tokens_per_second == pytest.approx(f.tokens_per_second, rel=0.15), k


def test_the_chosen_layouts_plan_is_handed_to_the_loader_unchanged(store):
    """auto keeps the plan of the layout it chose (plan.keep_plan), so the loader does not
    lay the epoch out and count it again; only the same arguments get it, and it equals
    the plan built afresh."""
    import numpy as np

    from pitstop.batching import plan as plan_mod
    from pitstop.batching.loader import LoaderOptions, MicroBatchLoader
    from pitstop.batching.settings import BatchSettings

    cfg = RunConfig(max_seq_len=MSL, tokens_per_step=8 * MSL)

    def run(batch):
        pass

    run.attention = "sdpa_docs"
    choice = choose_batching(store, cfg, run)
    kept = next(iter(plan_mod._KEPT.values()))
    assert kept.strategy == choice.strategy == "pack" and kept.efficiencies
    settings = BatchSettings.from_config(cfg, strategy=choice.strategy)
    loader = MicroBatchLoader(store, settings, LoaderOptions(workers=0))
    assert loader.plan(0) is kept and not plan_mod._KEPT  # used once, then released
    fresh = MicroBatchLoader(store, settings, LoaderOptions(workers=0)).plan(0)
    assert fresh is not kept
    for name in ("seqs", "row_bounds", "step_bounds", "row_tokens"):
        assert np.array_equal(getattr(fresh, name), getattr(kept, name)), name
    # another epoch, seed or subset of the store is planned, not handed the kept one
    choose_batching(store, cfg, run)
    again = next(iter(plan_mod._KEPT.values()))
    other = MicroBatchLoader(store, settings, LoaderOptions(workers=0), indices=np.arange(100))
    assert other.plan(0) is not again and other.plan(0).n_steps < again.n_steps
