"""Attaches pitstop's step timer to a Python process started by `pitstop profile -- CMD`.

`pitstop profile` puts this directory first on PYTHONPATH, so every Python process the
command starts (the script, a torchrun launcher and its workers) imports this file at
start-up. It attaches only when PITSTOP_WATCH_OUTPUT is set, never in multiprocessing's
helper processes (DataLoader workers, the resource tracker), and then runs the
sitecustomize it shadows, if the environment has one. Under `pitstop tune -- CMD`
(PITSTOP_TRIAL_SETTINGS set) it also applies the trial's settings after the timer is
attached, so the trial's step limit runs after the timer has closed the step
(`pitstop.tune.script_settings`).
"""

import os
import sys


def _attach() -> None:
    if not os.environ.get("PITSTOP_WATCH_OUTPUT"):
        return
    if any("multiprocessing" in a for a in getattr(sys, "orig_argv", [])):
        return  # a DataLoader worker or multiprocessing helper: its parent is the one timed
    try:
        from pitstop.anyloop.launch import attach_from_env

        attach_from_env()
    except Exception as e:  # never break the user's script: it runs untimed, and says so
        print(f"pitstop profile: could not attach the step timer: {e}", file=sys.stderr)
        return
    if os.environ.get("PITSTOP_TRIAL_SETTINGS"):
        # No try: a trial whose settings cannot be applied must fail, not measure the baseline.
        from pitstop.tune.script_settings import apply_from_env

        apply_from_env()


def _chain() -> None:
    """Run the sitecustomize this file shadows (a distribution's or a virtualenv's)."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None or spec.origin == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_attach()
_chain()
