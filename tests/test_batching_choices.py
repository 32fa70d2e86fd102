"""The measured-choices cache: what the key depends on, reuse, --remeasure, resume from the run."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from pitstop.batching.choices import (
    choice_key,
    read_run_choices,
    resolve_measured,
    write_run_choices,
)
from pitstop.core.config import RunConfig


@pytest.fixture()
def files(tmp_path: Path) -> tuple[Path, Path]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    manifest = tmp_path / "store" / "manifest.json"
    manifest.parent.mkdir()
    manifest.write_text('{"n_tokens": 100}')
    return model, manifest


def _key(model: Path, manifest: Path, **over) -> str:
    cfg = RunConfig(model=str(model), **{"max_seq_len": 64, **over})
    return choice_key(cfg, device_name="cpu", device_count=1, store_manifest=manifest)[0]


def test_the_key_follows_what_the_measurement_depends_on(files):
    model, manifest = files
    base = _key(model, manifest)
    assert base == _key(model, manifest)
    # Settings that change what is timed, or how fast: a new measurement.
    for over in ({"tokens_per_step": 512}, {"seed": 1}, {"micro_batch_size": 4},
                 {"gradient_checkpointing": True}, {"max_seq_len": 128}):  # fmt: skip
        assert _key(model, manifest, **over) != base, over
    # Settings that change no timing: the same measurement.
    for over in ({"lr": 1e-2}, {"max_steps": 9}, {"output": "elsewhere"}, {"save_steps": 3}):
        assert _key(model, manifest, **over) == base, over
    cfg = RunConfig(model=str(model), max_seq_len=64)
    assert (
        choice_key(cfg, device_name="NVIDIA H100", device_count=1, store_manifest=manifest)[0]
        != base
    )
    assert choice_key(cfg, device_name="cpu", device_count=2, store_manifest=manifest)[0] != base
    (model / "config.json").write_text('{"hidden_size": 128}')  # another model
    assert _key(model, manifest) != base
    manifest.write_text('{"n_tokens": 101}')  # another token store
    assert _key(model, manifest) != base


class Measure:
    def __init__(self, value: str) -> None:
        self.value = value
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return {"batching": self.value}, {"batching": f"timed {self.value}"}, {"noise": 0.01}


def _resolve(cache: Path, measure: Measure, **kw):
    clock = lambda: datetime(2026, 11, 23, 16, 40, tzinfo=timezone.utc)  # noqa: E731
    return resolve_measured(key="k1", key_fields={"format": 1}, cache_dir=cache,
                            measure=measure, now=clock, **kw)  # fmt: skip


def test_measured_once_then_reused_and_remeasure_measures_again(tmp_path):
    cache = tmp_path / "cache"
    m = Measure("bucket")
    first = _resolve(cache, m)
    assert m.calls == 1 and first.source == "measured" and first.values == {"batching": "bucket"}
    assert first.describe("batching") == "measured 2026-11-23 16:40 UTC: timed bucket"
    again = _resolve(cache, Measure("pad"))  # a rerun: the stored measurement, not a new one
    assert again.source == "reused" and again.values == {"batching": "bucket"}
    assert again.describe("batching").startswith("reused, measured 2026-11-23 16:40 UTC")
    assert again.measurements == {"noise": 0.01}
    m2 = Measure("pad")
    forced = _resolve(cache, m2, remeasure=True)
    assert m2.calls == 1 and forced.values == {"batching": "pad"} and forced.source == "measured"
    assert _resolve(cache, Measure("pack")).values == {"batching": "pad"}  # the new entry stays


def test_a_measurement_skipped_by_its_payoff_is_not_cached(tmp_path):
    """The cost model decided because measuring would not pay on that (short) run: a later,
    longer run of the configuration must still measure, so nothing is stored."""
    from pitstop.batching.choices import NOT_MEASURED

    cache = tmp_path / "cache"

    def cost_model():
        return {"batching": "pack"}, {"batching": "cost model"}, {NOT_MEASURED: {"worth": False}}

    assert _resolve(cache, cost_model).values == {"batching": "pack"}
    m = Measure("bucket")
    assert _resolve(cache, m).values == {"batching": "bucket"} and m.calls == 1


def test_a_damaged_entry_is_measured_again(tmp_path):
    cache = tmp_path / "cache"
    _resolve(cache, Measure("bucket"))
    (cache / "choices" / "k1.json").write_text("{not json")
    m = Measure("pad")
    assert _resolve(cache, m).values == {"batching": "pad"} and m.calls == 1


def test_resume_takes_the_runs_record_and_never_measures(tmp_path):
    cache, run = tmp_path / "cache", tmp_path / "run"
    run.mkdir()
    first = _resolve(cache, Measure("bucket"))
    write_run_choices(run, first)
    _resolve(cache, Measure("pad"), remeasure=True)  # the cache moved on since

    class Never(Measure):
        def __call__(self):
            raise AssertionError("a resumed run measured")

    kept = _resolve(cache, Never("x"), run_dir=run, resume=True)
    assert kept.values == {"batching": "bucket"} and kept.source == "run"
    assert "kept from this run" in kept.describe("batching")
    assert json.loads((run / "choices.json").read_text())["values"] == {"batching": "bucket"}
    assert read_run_choices(tmp_path / "nowhere") is None
