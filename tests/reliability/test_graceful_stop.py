"""SIGTERM and SIGINT finish the step, save a checkpoint, and print a resume command that works.

tests/test_train_run.py checks that SIGTERM saves and mentions --resume; here both
signals go through the real CLI, and the exact command printed is run as printed:
it must continue the run to the same bits as a run never stopped.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import sys

import pytest
from _rel import (
    assert_same_as,
    check_accepted_checkpoints,
    metric_lines,
    no_traceback,
    run,
    start,
    train_cmd,
    wait_until,
)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_saves_and_the_printed_command_resumes_exactly(
    sig, tiny_model_dir, rel_store, reference, tmp_path
):
    out = tmp_path / "out"
    proc = start(train_cmd(tiny_model_dir, rel_store, out))
    try:
        # Mid-run, between checkpoints (saves are at even steps): the stop must save its own.
        assert wait_until(lambda: len(metric_lines(out)) >= 3, proc, "step 3"), "run ended early"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + int(sig), err[-3000:]
    no_traceback(err)
    assert f"{sig.name} received: finishing step" in err
    stopped = json.loads((out / "summary.json").read_text())
    assert stopped["status"] == "interrupted"
    last = stopped["optimizer_steps"]
    assert check_accepted_checkpoints(out)[-1] == last, "the stop did not save its last step"
    assert [r["step"] for r in metric_lines(out)] == list(range(1, last + 1))

    m = re.search(r"Resume with:\n  (pitstop train .*)\n", err)
    assert m, err[-2000:]
    argv = shlex.split(m.group(1))
    assert argv[:2] == ["pitstop", "train"] and "--resume" in argv
    done = run([sys.executable, "-m", "pitstop", *argv[1:]])
    assert done.returncode == 0, done.stderr[-3000:]
    no_traceback(done.stderr)
    assert f"resuming from {out / 'checkpoints' / f'step-{last}'}" in done.stderr
    assert_same_as(out, reference)
