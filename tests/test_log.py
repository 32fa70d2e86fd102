"""pitstop's stderr messages go through `logging`: --log-level / --quiet, captured streams."""

from __future__ import annotations

import logging

import pytest

from pitstop.core import log


def test_messages_follow_the_current_stderr_and_the_level(capsys):
    log.info("pitstop: an info line")
    log.warning("pitstop: warning: a warning line")
    err = capsys.readouterr().err
    assert "an info line" in err and "a warning line" in err
    before = log.logger.level
    try:
        log.set_level("warning")
        assert not log.progress_enabled()
        log.info("pitstop: hidden")
        log.warning("pitstop: warning: shown")
        err = capsys.readouterr().err
        assert "hidden" not in err and "shown" in err
    finally:
        log.logger.setLevel(before)
    with pytest.raises(ValueError, match="debug, info, warning, error"):
        log.set_level("loud")


def test_quiet_train_prints_no_banner_progress_or_result_and_restores_the_level(
    tiny_model_dir, tmp_path, tiny_tokenizer, capsys, monkeypatch
):
    from _train_util import make_store

    from pitstop.cli import main

    monkeypatch.setenv("PITSTOP_PROGRESS", "0")  # off a terminal: progress would be lines
    store = make_store(tmp_path / "s", tiny_tokenizer)
    out = tmp_path / "out"
    args = ["train", "--model", str(tiny_model_dir), "--data", str(store), "--output", str(out),
            "--max-seq-len", "64", "--tokens-per-step", "256", "--micro-batch-size", "2",
            "--batching", "pack", "--max-steps", "2", "--log-steps", "1", "--report-to", "none",
            "--cache-dir", str(tmp_path / "cache"), "--compile", "off"]  # fmt: skip
    assert main([*args, "--quiet"]) == 0
    err = capsys.readouterr().err
    assert (out / "summary.json").is_file()
    assert "step 1/2" not in err and "tokens/s" not in err and "precision" not in err, err
    assert log.logger.level == logging.INFO  # the next command in this process is not quiet
    assert main([*args, "--overwrite", "--log-level", "info"]) == 0
    err = capsys.readouterr().err
    assert "step 1/2" in err and "pitstop: 2 steps" in err
