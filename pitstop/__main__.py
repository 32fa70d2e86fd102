"""`python -m pitstop ...` is the `pitstop` command (torchrun launches it this way)."""

from pitstop.cli import entry

entry()
