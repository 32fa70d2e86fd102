"""build_run assembles a run without touching its output directory; the Trainer takes it as is."""

from __future__ import annotations

from pitstop.probe import DeviceInfo

CPU = DeviceInfo(type="cpu", name="test cpu", cpu_count=2)


def test_build_run_writes_nothing_and_the_trainer_receives_its_parts(
    tiny_model_dir, store, tmp_path
):
    from _train_util import train_config

    from pitstop.train.build import build_run
    from pitstop.train.trainer import Trainer

    out = tmp_path / "out"
    run = build_run(train_config(tiny_model_dir, store, out), device=CPU)
    assert not out.exists()  # a ConfigError later would leave no trace
    assert run.total_steps == 6 and run.geometry.tokens_per_step == 256
    assert {"device", "precision", "batching", "compile", "optimizer", "checkpoints"} <= set(
        run.choices
    )
    assert run.precision == "fp32" and run.scaler is None and not run.compiled
    tr = Trainer(run)
    assert tr.run is run and tr.cadence.last_step == run.total_steps
    assert not hasattr(tr, "model") and tr.state.step == 0  # parts are read as tr.run.X
