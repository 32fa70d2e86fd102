"""A training process's start-up, before anything is loaded: the output directory's check
(nothing written yet), the seeds, transformers' progress bars off, and the time the process
started (`build_run` calls these first, in this order)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import psutil
import torch

from pitstop import probe
from pitstop.core.config import RunConfig
from pitstop.core.errors import ConfigError


def check_output_dir(cfg: RunConfig) -> Path:
    """Refuse to touch a directory holding a run unless --resume or --overwrite. Writes nothing."""
    problem = probe.output_dir_problem(cfg.output, resume=cfg.resume, overwrite=cfg.overwrite)
    if problem:
        raise ConfigError(problem)
    return Path(cfg.output)


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's generators (every CUDA device's too) from one seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def quiet_transformers() -> None:
    """save_pretrained's per-shard progress bars would interleave with the run's own bar."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def process_start() -> float:
    """When this process started (time.time() scale): a run's wall seconds count from it."""
    try:
        return float(psutil.Process().create_time())
    except Exception:  # psutil is a dependency, but a missing /proc must not stop a run
        return time.time()
