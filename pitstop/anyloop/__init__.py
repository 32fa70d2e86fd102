"""Explain any PyTorch training loop: `pitstop profile -- python train.py` and `pitstop.watch`.

`timer.py` holds the timer (torch's global optimizer, module and DataLoader hooks feeding
PitstopCallback's step bookkeeping); `launch.py` runs a command with it attached.
"""

from __future__ import annotations

from pitstop.anyloop.timer import Watch, watch

__all__ = ["Watch", "watch"]
