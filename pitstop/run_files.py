"""The names of what a run directory (`pitstop train --output OUT_DIR`) holds.

Writers and readers (train, measure, report, demo, probe) take the names from here, so
a rename is one edit and `--overwrite` knows exactly what a run wrote.
"""

from __future__ import annotations

SUMMARY = "summary.json"  # the run's results (docs/run-directory.md)
METRICS = "metrics.jsonl"  # one line per optimizer step
CONFIG = "config.yaml"  # the run's configuration, for --resume
CHECKPOINTS = "checkpoints"  # checkpoints/step-N/, best.json
FINAL = "final"  # the HF-loadable model (or PEFT adapter)
MERGED = "merged"  # --merge-lora: the adapter merged into its base, a plain HF model
TENSORBOARD = "tensorboard"  # TensorBoard events
PROFILE = "profile.json"  # `pitstop profile --output`'s default name
REPORT = "report.html"  # `pitstop report`'s default name
FINDINGS = "findings.json"  # the doctor's findings beside a run (the demo writes them)

WANDB_ID = "wandb-run-id"  # the wandb run this run logs to (--resume continues that run)
CHOICES = "choices.json"  # the measured choices the run trains with (--resume reads them)

# What `pitstop train` writes, and so what --overwrite removes (never the user's other files).
RUN_FILES = (SUMMARY, METRICS, CONFIG, CHOICES, WANDB_ID)
RUN_DIRS = (CHECKPOINTS, FINAL, MERGED, TENSORBOARD)
# Any of these present means the directory already holds a run.
RUN_MARKERS = (SUMMARY, CHECKPOINTS, FINAL)
