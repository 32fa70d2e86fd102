"""Quiet start (issue 24, item 5): importing `pitstop.hf` or running `pitstop doctor` does
not import bitsandbytes (whose import warning opened every output), and 8-bit / 4-bit
support still loads it when asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip


def test_importing_pitstop_hf_does_not_import_bitsandbytes(tmp_path: Path) -> None:
    r = _python(
        "import sys, pitstop.hf, peft.import_utils as u\n"
        "print('BNB', 'bitsandbytes' in sys.modules, 'peft' in sys.modules)\n"
        # peft's availability check is not poisoned by the block: 4-bit support still shows.
        "print('AVAILABLE', u.is_bnb_available())\n",
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "BNB False True" in r.stdout
    assert "AVAILABLE True" in r.stdout
    assert "gemm_4bit" not in r.stderr and "kernels-community" not in r.stderr


def test_doctor_on_hf_arguments_does_not_import_bitsandbytes(tmp_path: Path) -> None:
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"per_device_train_batch_size": 4, "gradient_checkpointing": True}))
    r = _python(
        "import sys\n"
        "from pitstop.cli import main\n"
        f"rc = main(['doctor', '--no-compile-check', '--hf-args', {str(args)!r}])\n"
        "print('BNB', 'bitsandbytes' in sys.modules, 'transformers' in sys.modules)\n"
        "print('--- asking for bitsandbytes', file=sys.stderr, flush=True)\n"
        "import bitsandbytes\n"  # asked for later (an 8-bit optimizer): it loads as usual
        "print('LOADED', 'bitsandbytes' in sys.modules)\n",
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "BNB False True" in r.stdout and "LOADED True" in r.stdout
    before = r.stderr.split("--- asking for bitsandbytes")[0]
    assert "gemm_4bit" not in before and "kernels-community" not in before
